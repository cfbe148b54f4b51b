"""Memory: activation bytes each stage keeps for backward, per checkpoint mode, against GPipe's bound.

With re-computation a stage needs, at its peak, the inputs of its ``M`` micro-batches (kept from forward to
backward) plus one micro-batch's activations inside the stage (rebuilt during that micro-batch's backward): the
bound of the GPipe paper. The peak here is what the stage keeps after its forward, plus one micro-batch's
re-computed activations when the first micro-batch to go backward (the last one) is checkpointed. How it is counted:
see :mod:`ranks.memory`. Re-computation's time cost is reported separately, as step times per mode.
"""

from __future__ import annotations

from typing import Any

from harness.measurements import NUM_STAGES, measured
from harness.report import markdown_table, verdict
from harness.summarize import median, median_ratio
from harness.workload import workload

TARGET_RATIO = 1.1


def run(quick: bool) -> dict[str, Any]:
    work = workload(quick)
    answers = sorted(measured("memory", quick), key=lambda answer: answer["stage"])
    modes = answers[0]["modes"]
    stages = [_stage_rows(answer, modes) for answer in answers]
    m = answers[0]["micro_batches"]
    mib = 2**20
    table = markdown_table(
        ["stage", "checkpoint", "kept after forward (MiB)", "peak in backward (MiB)", "GPipe bound (MiB)", "peak / bound"],
        [
            [s["stage"], mode, f"{s[mode]['kept_bytes'] / mib:.2f}", f"{s[mode]['peak_bytes'] / mib:.2f}",
             f"{s['bound_bytes'] / mib:.2f}", f"{s[mode]['peak_bytes'] / s['bound_bytes']:.3f}"]
            for s in stages
            for mode in modes
        ],
    )
    rounds = answers[0]["step_s"]
    step_s = {mode: median(rounds[mode]) for mode in modes}
    cost = {mode: median_ratio(rounds[mode], rounds["never"]) for mode in modes}
    times = markdown_table(
        ["checkpoint", "step (ms, median)", "against never (median over rounds)"],
        [[mode, f"{1e3 * step_s[mode]:.1f}", f"{cost[mode]:.3f}"] for mode in modes],
    )
    worst = max(s["always"]["peak_bytes"] / s["bound_bytes"] for s in stages)
    markdown = (
        f"{work.description}; M={m}, {NUM_STAGES} stages. Bound per stage: M × (one micro-batch's stage input) +"
        " (the activations one micro-batch saves inside the stage).\n\n"
        f"{table}\n\n"
        + verdict(f'`checkpoint="always"` peak within {TARGET_RATIO - 1:.0%} of the bound on every stage', worst <= TARGET_RATIO, f"{worst:.3f} at worst")
        + "\n\nRe-computation's cost, step time per mode (same run, modes taking turns):\n\n"
        + times
    )
    data = {
        "num_stages": NUM_STAGES, "workload": work.to_spec(), "micro_batches": m, "stages": stages,
        "step_s": step_s, "recomputation_cost": cost, "step_s_per_round": rounds,
    }
    return {"title": "Activation memory against GPipe's bound", "markdown": markdown, "data": data}


def _stage_rows(answer: dict[str, Any], modes: list[str]) -> dict[str, Any]:
    m, inside, boundary = answer["micro_batches"], answer["inside_bytes"], answer["boundary_bytes"]
    row: dict[str, Any] = {"stage": answer["stage"], "bound_bytes": m * boundary + inside, "inside_bytes": inside,
                           "boundary_bytes": boundary}
    for mode in modes:
        # Backward starts with the last micro-batch: its activations are rebuilt on top of what is kept if it is
        # checkpointed; otherwise they are part of what is kept, and later re-computations only replace them.
        recomputed_first = mode == "always" or (mode == "except_last" and m == 1)
        kept = answer[mode]
        row[mode] = {"kept_bytes": kept, "peak_bytes": kept + (inside if recomputed_first else 0)}
    return row
