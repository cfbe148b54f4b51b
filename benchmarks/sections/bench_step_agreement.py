"""The step agreement's cost: what comparing the stages' steps (their loop, batch, the batch's shapes and dtypes)
adds to a step, on a small 2-stage model whose short steps show a cost per step most.

The check rides on the header of each step's first message between two stages, so it adds no message: its cost is
CPU work on each rank. Measured two ways in one launch (see :mod:`ranks.step_agreement`): that work timed alone,
against the step's CPU time; and fits with the check on and off taking turns, whose ratio shows it within the noise.
"""

from __future__ import annotations

import os
from typing import Any

import ranks.step_agreement
from harness.launch import launch
from harness.report import markdown_table, verdict
from harness.summarize import median, median_ratio
from harness.workload import Workload

TARGET_COST = 0.01
NUM_STAGES = 2
# Small blocks, so that a step lasts milliseconds and a per-step cost shows; M = 8 messages per step and direction.
MODEL = Workload(width=64, depth=8, batch=64, micro_batches=(8,), warmup=0, rounds=0, fits=0, steps_per_fit=40)
QUICK_MODEL = Workload(width=32, depth=4, batch=32, micro_batches=(4,), warmup=0, rounds=0, fits=0, steps_per_fit=8)
ROUNDS, QUICK_ROUNDS = 6, 1


def run(quick: bool) -> dict[str, Any]:
    work, rounds = (QUICK_MODEL, QUICK_ROUNDS) if quick else (MODEL, ROUNDS)
    m = work.micro_batches[0]
    answers = launch(ranks.step_agreement.measure, NUM_STAGES,
                     {"workload": work.to_spec(), "micro_batches": m, "rounds": rounds})
    # Per round, the step's CPU time summed over the ranks (each rank's median step); the wall-clock step of rank 0.
    on_cpu = [sum(steps) for steps in zip(*(a["on_cpu_s"] for a in answers))]
    off_cpu = [sum(steps) for steps in zip(*(a["off_cpu_s"] for a in answers))]
    on, off = answers[0]["on_s"], answers[0]["off_s"]
    check_s = sum(a["check_s"] for a in answers)  # every rank's work for one step
    direct = check_s / median(off_cpu)
    cpu_cost, wall_cost = median_ratio(on_cpu, off_cpu) - 1, median_ratio(on, off) - 1
    spread = [f"{n / d - 1:+.1%}" for n, d in zip(on_cpu, off_cpu)]
    table = markdown_table(
        ["model", "pairs", "check alone (µs/step, all ranks)", "step CPU, off (ms, all ranks)", "check / step",
         "fits: CPU on/off", "fits: wall-clock on/off"],
        [[f"{work.depth} × Linear({work.width}, {work.width}), batch {work.batch}, {NUM_STAGES} stages, M = {m}",
          rounds, f"{1e6 * check_s:.1f}", f"{1e3 * median(off_cpu):.2f}", f"{direct:+.2%}", f"{cpu_cost:+.2%}",
          f"{wall_cost:+.2%}"]],
    )
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    markdown = (
        f"Fits of {work.steps_per_fit} steps with the check on and off taking turns, in alternating order ({rounds}"
        " measured pairs after one unmeasured), each fit's median step; off, the runtime computes no step signature,"
        " so no message carries one and none is compared. The check alone: each rank timed both ends' work of one step"
        " (the step's signature, a first message's header with it less one without, read back, the comparison: an"
        " upper bound, as a stage of 2 sends or receives) over thousands of repetitions, the best of five, summed over"
        f" the ranks, against the step's CPU time summed over the ranks. The fits' ratios per pair (CPU): {', '.join(spread)}: their spread is the noise the check hides"
        f" in.\n\n{table}\n\nLoad average (1, 5, 15 min) at the end: {load}.\n\n"
        + verdict(f"step agreement ≤ {TARGET_COST:.0%} of the step (the check alone, CPU time)", direct <= TARGET_COST,
                  f"{direct:+.2%} (fits on/off: CPU {cpu_cost:+.2%}, wall-clock {wall_cost:+.2%})")
    )
    data = {"workload": work.to_spec(), "micro_batches": m, "pairs": rounds, "check_s": check_s,
            "check_per_rank_s": [a["check_s"] for a in answers], "direct_cost": direct, "cpu_cost": cpu_cost,
            "wall_cost": wall_cost, "on_cpu_s": on_cpu, "off_cpu_s": off_cpu, "on_s": on, "off_s": off,
            "target": TARGET_COST}
    return {"title": "Step agreement overhead", "markdown": markdown, "data": data}
