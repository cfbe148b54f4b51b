"""Against the peer: lightning_pipe's step time over torch.distributed.pipelining's (``ScheduleGPipe``).

Same model, stages, micro-batches, processes and threads, measured in the same launch as the pipeline section
(see :mod:`measurements`). A ratio below 1 means lightning_pipe is faster.
"""

from __future__ import annotations

from typing import Any

from report import markdown_table, verdict
from measurements import NUM_STAGES, measured
from workload import workload

TARGET_RATIO = 0.95


def run(quick: bool) -> dict[str, Any]:
    work = workload(quick)
    times = measured("speed", quick)[0]
    rows = [
        {
            "micro_batches": m,
            "t_ours_s": times[f"ours/{m}"],
            "t_peer_s": times[f"peer/{m}"],
            "ratio": times[f"ours/{m}"] / times[f"peer/{m}"],
        }
        for m in work.micro_batches
    ]
    table = markdown_table(
        ["M", "lightning_pipe (ms)", "torch.distributed.pipelining (ms)", "ours / theirs"],
        [[r["micro_batches"], f"{1e3 * r['t_ours_s']:.1f}", f"{1e3 * r['t_peer_s']:.1f}", f"{r['ratio']:.3f}"] for r in rows],
    )
    m = work.reference_micro_batches
    ratio = next(r["ratio"] for r in rows if r["micro_batches"] == m)
    markdown = (
        f"{work.description}, `checkpoint=\"never\"`, {NUM_STAGES} stages; the peer is `PipelineStage` +"
        " `ScheduleGPipe` with a per-micro-batch MSE loss, lightning_pipe computes the same loss on the joined"
        f" output.\n\n{table}\n\n"
        + verdict(f"step time at M={m} ≤ {TARGET_RATIO} × torch.distributed.pipelining's", ratio <= TARGET_RATIO, f"{ratio:.3f}")
    )
    data = {"num_stages": NUM_STAGES, "workload": work.to_spec(), "rows": rows}
    return {"title": "Against torch.distributed.pipelining", "markdown": markdown, "data": data}
