"""Balancing: step time with ``balance="time"`` against ``balance="uniform"`` on a model whose first half costs 7x.

The pipelined ``nn.Sequential`` holds ``2k`` blocks: ``k`` heavy blocks of 7 × (Linear(W, W) + ReLU), then ``k``
light blocks of 1 × (Linear(W, W) + ReLU), He-initialised: real matrix products, no sleeping. Split by layer count,
stage 0 gets all heavy blocks, 7/8 of the work; the best contiguous split is about 1.7 times faster in theory.
Two stages, one compute thread per process; the two modes take turns (one fit of each per round, their order
swapped every round, after one unmeasured round), and a step's time is the interval between consecutive step ends
on global rank 0, the first of each fit dropped. The speedup is the median over rounds of uniform's median step over
time's, so that a change in the machine's load between rounds cancels out.

Two processes computing at once each run slower than one alone on a small or shared machine (shared caches and
memory bandwidth, other work on the cores). The uniform split leaves stage 1 mostly idle, so its step runs at about
one process's speed; the balanced split keeps both stages computing and pays that contention. Between the two fits
of every round the section therefore also times the heavy half's forward + backward in one process alone and in
both at once: their ratio ``c`` is the machine's contention factor, and :func:`speedup_without_contention` takes it
out of the measured speedup.
"""

from __future__ import annotations

import os
from typing import Any

from harness.launch import launch
from harness.report import markdown_table, verdict
from harness.summarize import median, median_ratio
from lightning_pipe.partition.counts import PipelineParallelConfig
from lightning_pipe.partition.balance import min_max_partition, ranges_from_sizes, stage_costs
from ranks import balance
from ranks.balance import HEAVY_FACTOR, MODES

NUM_STAGES = 2
TARGET_SPEEDUP = 1.4


def sizes(quick: bool) -> dict[str, int]:
    if quick:
        return {"width": 64, "blocks_per_half": 4, "batch": 32, "micro_batches": 4, "steps": 4, "rounds": 1}
    # Short fits, many rounds: the two fits of a round run close together, and the median over rounds has more to
    # choose from (8 rounds of 6 steps take about as long as 5 of 10: a fit's start-up costs about 4 steps).
    return {"width": 256, "blocks_per_half": 16, "batch": 128, "micro_batches": 8, "steps": 6, "rounds": 8}


def run(quick: bool) -> dict[str, Any]:
    spec = sizes(quick)
    load_before = os.getloadavg()[0]
    answer = launch(balance.measure, NUM_STAGES, spec)[0]
    load = max(load_before, os.getloadavg()[0])
    rounds = answer["per_round"]
    speedups = [r["uniform"]["step_s"] / r["time"]["step_s"] for r in rounds]
    factors = [r["side_by_side_s"] / r["alone_s"] for r in rounds]
    speedup = median(speedups)
    factor = median(factors)
    uncontended = median([speedup_without_contention(r, c) for r, c in zip(rounds, factors)])
    last = rounds[-1]
    summary = {
        mode: {
            **{key: median([r[mode][key] for r in rounds]) for key in ("step_s", "slowest_busy_s", "least_busy_s")},
            "ranges": last[mode]["ranges"],
            "imbalance": last[mode]["imbalance"],
        }
        for mode in MODES
    }
    busy_speedup = median_ratio(
        [r["uniform"]["slowest_busy_s"] for r in rounds], [r["time"]["slowest_busy_s"] for r in rounds]
    )
    k = spec["blocks_per_half"]
    costs = [float(HEAVY_FACTOR)] * k + [1.0] * k
    uniform_ranges = PipelineParallelConfig(NUM_STAGES, spec["micro_batches"]).split_into_stages(2 * k)
    best_ranges = ranges_from_sizes(min_max_partition(costs, NUM_STAGES))
    theory = max(stage_costs(costs, uniform_ranges)) / max(stage_costs(costs, best_ranges))
    table = markdown_table(
        ["balance", "blocks per stage", "measured imbalance", "slowest stage busy (ms)", "least busy stage (ms)",
         "step (ms, median)"],
        [
            [
                f'`"{mode}"`',
                " + ".join(str(stop - start) for start, stop in summary[mode]["ranges"]),
                f"{summary[mode]['imbalance']:.2f}",
                f"{1e3 * summary[mode]['slowest_busy_s']:.1f}",
                f"{1e3 * summary[mode]['least_busy_s']:.1f}",
                f"{1e3 * summary[mode]['step_s']:.1f}",
            ]
            for mode in MODES
        ],
    )
    contention_table = markdown_table(
        ["timed", "one process alone (ms)", "both processes at once (ms)", "contention factor c"],
        [["heavy blocks' forward + backward, one step's micro-batches",
          f"{1e3 * median([r['alone_s'] for r in rounds]):.1f}",
          f"{1e3 * median([r['side_by_side_s'] for r in rounds]):.1f}", f"{factor:.2f}"]],
    )
    markdown = (
        f"{k} heavy blocks (7 × (Linear({spec['width']}, {spec['width']}) + ReLU)) then {k} light blocks (1 ×),"
        " He-initialised (with the default initialisation, gradients through this many ReLU layers become denormal"
        f" floats, which the CPU computes many times slower), batch"
        f" {spec['batch']}, {NUM_STAGES} stages, M={spec['micro_batches']}, `checkpoint=\"except_last\"`, SGD; one"
        f" thread per process; {len(rounds)} round{'s' if len(rounds) > 1 else ''}, each a fit of {spec['steps']}"
        " steps per mode, the order swapped every round (the first step of each fit and one warm-up round dropped);"
        " step: median over the"
        f" {sum(len(r['uniform']['intervals']) for r in rounds)} measured steps of each mode; speedup: median over"
        " rounds of the ratio of the two modes' median steps. Measured imbalance (last round): slowest stage's busy"
        " time (forwards + backwards) over the mean, from the stage summary; busy times: medians over rounds of each"
        f" fit's median. The split by block FLOPs would be {theory:.2f}× faster than the uniform one (bubble"
        " ignored).\n\n"
        f"{table}\n\n"
        + verdict(
            f'`balance="time"` ≥ {TARGET_SPEEDUP}× faster per step than `"uniform"`',
            speedup >= TARGET_SPEEDUP,
            f"{speedup:.2f}×",
        )
        + f" Per round it ranged from {min(speedups):.2f}× to {max(speedups):.2f}×.\n\n"
        "What the machine allows: between the two fits of every round, the forward + backward of the heavy blocks"
        " over one step's micro-batches (what the uniform split's stage 0 computes in a step, re-computation aside)"
        " ran in one process while the other waited, and in both processes at once (the slower of the two), twice"
        " each; c is their ratio, the median over rounds.\n\n"
        f"{contention_table}\n\n"
        "While both stages compute, each runs c times slower than alone; the uniform split's light stage 1 computes"
        " little, so its step hardly pays that, while the balanced split's stages overlap most of the step. Factored"
        " out, a step would take `step - (1 - 1/c) × least busy stage's time`: the less busy stage is taken to"
        " compute only while the other one does (an upper bound on their overlap, so the estimate leans high), and"
        " that overlap to shrink by 1/c. The speedup without contention is uniform's step so corrected over time's,"
        f" per round, then the median: `balance=\"time\"` would be **{uncontended:.2f}×** faster per step than"
        f" `\"uniform\"` (measured: {speedup:.2f}×). The busy times are stretched by the same"
        f" contention: the slowest stage's busy time is {busy_speedup:.2f}× shorter with `\"time\"`, against the"
        f" {theory:.2f}× of the FLOPs. Load average during the run: up to {load:.1f} on {os.cpu_count()} cores (on a"
        " loaded machine c includes the cores' time shared with other work)."
    )
    data = {
        **spec, **answer, **summary, "round_speedups": speedups, "round_contention_factors": factors,
        "speedup": speedup, "contention_factor": factor, "speedup_without_contention": uncontended,
        "theoretical_speedup": theory, "busy_speedup": busy_speedup, "load_average": load,
    }
    return {"title": "Balancing by measured time", "markdown": markdown, "data": data}


def speedup_without_contention(round_: dict[str, Any], factor: float) -> float:
    """Uniform's step over time's in one round, each step less what contention added to it.

    While both stages compute, each runs ``factor`` times slower than alone. The less busy stage is taken to compute
    only while the other one does, so ``least_busy_s`` bounds the time both computed, and that time would shrink
    by ``1 / factor``: a step without contention is ``step_s - (1 - 1 / factor) * least_busy_s``.
    """

    def step(mode: str) -> float:
        return round_[mode]["step_s"] - (1 - 1 / factor) * round_[mode]["least_busy_s"]

    return step("uniform") / step("time")
