"""Pipeline speedup: one process holding the whole model against 2 stages, and the engine's own efficiency.

For each M the 2-stage step is compared with two references measured in the same launch (see :mod:`measurements`):

* one process running the whole model on the whole batch: ``speedup = t_one / t_pipeline``, shown next to the
  textbook ideal ``S * M / (M + S - 1)``;
* ``t_mb``, one process's forward + backward of one micro-batch through the whole model. The ideal pipeline step is
  ``(M + S - 1) * t_mb / S`` (the bubble and the lower efficiency of smaller matrix products already included), and
  ``engine efficiency = ideal / measured``: 1.0 means the engine adds nothing to the schedule's own cost.
"""

from __future__ import annotations

from typing import Any

from report import markdown_table, verdict
from measurements import NUM_STAGES, measured
from workload import Workload, workload

TARGET_EFFICIENCY = 0.9


def run(quick: bool) -> dict[str, Any]:
    work = workload(quick)
    times = measured("speed", quick)[0]
    rows = [_row(times, m) for m in work.micro_batches]
    data = {"num_stages": NUM_STAGES, "workload": work.to_spec(), "rows": rows}
    return {"title": "Pipeline speedup and engine efficiency", "markdown": _markdown(work, rows), "data": data}


def _row(times: dict[str, float], m: int) -> dict[str, float]:
    t_one, t_mb, t_pipe = times["one_process"], times[f"micro_batch/{m}"], times[f"ours/{m}"]
    t_mb_side_by_side = times[f"micro_batch_side_by_side/{m}"]
    ideal_step = (m + NUM_STAGES - 1) * t_mb / NUM_STAGES
    return {
        "micro_batches": m,
        "t_one_s": t_one,
        "t_pipeline_s": t_pipe,
        "t_mb_s": t_mb,
        "speedup": t_one / t_pipe,
        "ideal_speedup": NUM_STAGES * m / (m + NUM_STAGES - 1),
        "ideal_step_s": ideal_step,
        "efficiency": ideal_step / t_pipe,
        "t_mb_side_by_side_s": t_mb_side_by_side,
        "side_by_side_efficiency": (m + NUM_STAGES - 1) * t_mb_side_by_side / NUM_STAGES / t_pipe,
    }


def _markdown(work: Workload, rows: list[dict[str, float]]) -> str:
    table = markdown_table(
        ["M", "one process (ms)", f"{NUM_STAGES} stages (ms)", "speedup", "ideal S·M/(M+S-1)", "t_mb (ms)",
         "ideal step (ms)", "engine efficiency", "t_mb side by side (ms)", "efficiency against it"],
        [
            [r["micro_batches"], f"{1e3 * r['t_one_s']:.1f}", f"{1e3 * r['t_pipeline_s']:.1f}", f"{r['speedup']:.2f}",
             f"{r['ideal_speedup']:.2f}", f"{1e3 * r['t_mb_s']:.1f}", f"{1e3 * r['ideal_step_s']:.1f}",
             f"{r['efficiency']:.3f}", f"{1e3 * r['t_mb_side_by_side_s']:.1f}", f"{r['side_by_side_efficiency']:.3f}"]
            for r in rows
        ],
    )
    m = work.reference_micro_batches
    efficiency = next(r["efficiency"] for r in rows if r["micro_batches"] == m)
    return (
        f"{work.description}, `checkpoint=\"never\"`. Engine efficiency is the ideal step (M+S-1)·t_mb/S over the"
        " measured step, where t_mb is one process's forward + backward of one micro-batch through the whole"
        " model. The last two columns show what the machine allows: t_mb measured with every process running it at"
        " once (processes side by side share the memory system, and on a loaded machine the cores), and the"
        " efficiency against that.\n\n"
        f"{table}\n\n"
        + verdict(
            f"engine efficiency at M={m} with {NUM_STAGES} stages ≥ {TARGET_EFFICIENCY}",
            efficiency >= TARGET_EFFICIENCY,
            f"{efficiency:.3f}",
        )
    )
