"""Against the peer: lightning_pipe's step time over torch.distributed.pipelining's (``ScheduleGPipe``).

Same model, stages, micro-batches, processes and threads, measured in the same launch as the pipeline section
(see :mod:`harness.measurements`). A ratio below 1 means lightning_pipe is faster.
"""

from __future__ import annotations

from typing import Any

from harness.measurements import NUM_STAGES, speed, stage_counts
from harness.report import markdown_table, verdict
from harness.summarize import median, median_ratio
from harness.workload import workload

TARGET_RATIO = 0.95


def run(quick: bool) -> dict[str, Any]:
    work = workload(quick)
    rows = []
    for s in stage_counts():
        times = speed(s, quick)
        for m in work.micro_batches:
            ours, theirs = times[f"ours/{m}"], times[f"peer/{m}"]
            rows.append(
                {"num_stages": s, "micro_batches": m, "t_ours_s": median(ours), "t_peer_s": median(theirs),
                 "ratio": median_ratio(ours, theirs)}
            )
    table = markdown_table(
        ["S", "M", "lightning_pipe (ms)", "torch.distributed.pipelining (ms)", "ours / theirs"],
        [
            [r["num_stages"], r["micro_batches"], f"{1e3 * r['t_ours_s']:.1f}", f"{1e3 * r['t_peer_s']:.1f}",
             f"{r['ratio']:.3f}"]
            for r in rows
        ],
    )
    m = work.reference_micro_batches
    ratio = next(r["ratio"] for r in rows if r["micro_batches"] == m and r["num_stages"] == NUM_STAGES)
    markdown = (
        f"{work.description}, `checkpoint=\"never\"`; the peer is `PipelineStage` + `ScheduleGPipe` with a"
        " per-micro-batch MSE loss, lightning_pipe computes the same loss on the joined output. Times are medians;"
        " the ratio is the median over rounds of the two step times measured in the same round.\n\n"
        f"{table}\n\n"
        + verdict(
            f"step time at M={m}, {NUM_STAGES} stages ≤ {TARGET_RATIO} × torch.distributed.pipelining's",
            ratio <= TARGET_RATIO,
            f"{ratio:.3f}",
        )
    )
    data = {"stage_counts": list(stage_counts()), "workload": work.to_spec(), "rows": rows}
    return {"title": "Against torch.distributed.pipelining", "markdown": markdown, "data": data}
