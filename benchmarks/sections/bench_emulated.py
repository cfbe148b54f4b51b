"""Schedules at scale (emulated): every schedule of ours at 4 and 8 stages on emulated devices, beside
torch.distributed.pipelining's counterpart on the same blocks and beside the ideal step of its own tick table.

The blocks are :mod:`lightning_pipe.testing.emulate`'s: each forward, input gradient and weight gradient is a wait that leaves
the core free, so 8 processes on 2 cores measure what 8 accelerators would do with those kernel times, and the gap
between the measured step and the ideal one is the runtimes' own cost (actions, messages), which a real device would
pay too.
"""

from __future__ import annotations

import statistics
from typing import Any

import ranks.emulated
from harness.launch import launch
from harness.report import markdown_table, verdict
from harness.summarize import median, median_ratio
from lightning_pipe.partition.counts import PipelineParallelConfig
from lightning_pipe.schedules.builtin import SCHEDULES, gpipe_schedule
from lightning_pipe.schedules.planner import ComputeCosts, predict
from ranks.emulated import CONFIGURATIONS, PROFILES, block_times

# Seconds per stage and micro-batch for each of F, I, W. "Short" shows the runtime's own cost; "long" is the
# compute-dominated regime of the efficiency target.
SHORT, LONG = 0.016, 0.050
FULL_RUNS = (  # (stages, stage time, profiles, micro-batch counts): trimmed to fit a run of about ten minutes
    (4, SHORT, PROFILES, (4, 8, 16)),
    (4, LONG, ("uniform",), (8,)),
    (8, SHORT, PROFILES, (16,)),
)
QUICK_RUNS = ((2, 0.002, ("uniform",), (2,)),)
FULL_ROUNDS, QUICK_ROUNDS = (1, 3), (0, 1)  # (warm-up, measured) steps per configuration
WIDTH, ROWS = 1024, 16  # the activation of one micro-batch: ROWS x WIDTH floats (64 KiB)


def ideal(name: str, profile: str, num_stages: int, m: int, stage_time: float) -> tuple[float, float]:
    """The step that ``name``'s own tick table gives with the profile's costs (seconds, messages free: the planner's
    prediction), and the most micro-batches' activations a stage holds at once (in units of one stage's)."""
    schedule_name, v = CONFIGURATIONS[name]
    schedule = gpipe_schedule(split_backward=True) if schedule_name == "gpipe_split" else SCHEDULES[schedule_name]
    times = block_times(profile, num_stages, stage_time)
    costs = [
        ComputeCosts(*(sum(getattr(times[b], part) for b in blocks) for part in ("forward", "input_gradient",
                                                                                 "weight_gradient")), 1 / v)
        for blocks in PipelineParallelConfig(num_stages * v, m).split_into_stages(len(times))
    ]
    prediction = predict(schedule, num_stages, m, costs, v)
    return prediction.step, max(prediction.peak_activation_bytes)


def run(quick: bool) -> dict[str, Any]:
    warmup, rounds = QUICK_ROUNDS if quick else FULL_ROUNDS
    rows, gaps = [], []
    for num_stages, stage_time, profiles, micro_batches in QUICK_RUNS if quick else FULL_RUNS:
        spec = {
            "stage_time": stage_time, "profiles": list(profiles), "micro_batches": list(micro_batches),
            "configurations": list(CONFIGURATIONS), "width": WIDTH, "rows": ROWS, "warmup": warmup, "rounds": rounds,
        }
        answers = launch(ranks.emulated.measure, num_stages, spec, timeout=1800)
        times = answers[0]["times"]
        for profile in profiles:
            for m in micro_batches:
                gpipe = times[f"ours/{profile}/{m}/gpipe"]
                for name in CONFIGURATIONS:
                    key = f"{profile}/{m}/{name}"
                    ours, theirs = times[f"ours/{key}"], times.get(f"peer/{key}")
                    step, held = ideal(name, profile, num_stages, m, stage_time)
                    gap = [g for answer in answers for g in answer["gaps"][key]]
                    cpu_ours = sum(median(answer["cpu"][f"ours/{key}"]) for answer in answers)
                    cpu_peer = sum(median(answer["cpu"][f"peer/{key}"]) for answer in answers) if theirs else None
                    gaps += gap
                    rows.append({
                        "num_stages": num_stages, "stage_time": stage_time, "profile": profile, "micro_batches": m,
                        "schedule": name, "t_ours_s": median(ours), "t_ideal_s": step,
                        "efficiency": step / median(ours),
                        "t_peer_s": median(theirs) if theirs else None,
                        "peer_efficiency": step / median(theirs) if theirs else None,
                        "ours_over_peer": median_ratio(ours, theirs) if theirs else None,
                        "ours_over_gpipe": median_ratio(ours, gpipe),
                        "ideal_over_gpipe": step / ideal("gpipe", profile, num_stages, m, stage_time)[0],
                        "held_at_peak": held, "gap_median_s": statistics.median(gap) if gap else None,
                        "cpu_ours_s": cpu_ours, "cpu_over_peer": cpu_ours / cpu_peer if cpu_peer else None,
                    })
    markdown = _markdown(rows, gaps, warmup, rounds)
    return {"title": "Schedules at scale (emulated)", "markdown": markdown, "data": {"rows": rows}}


def _markdown(rows: list[dict[str, Any]], gaps: list[float], warmup: int, rounds: int) -> str:
    table = markdown_table(
        ["S", "F=I=W (ms)", "profile", "M", "schedule", "measured (ms)", "ideal (ms)", "efficiency",
         "torch's (ms)", "torch's efficiency", "ours / torch's", "ours / our gpipe", "ideal / ideal gpipe",
         "held at peak", "gap per action (ms)", "CPU per step (ms)", "CPU ours / torch's"],
        [
            [r["num_stages"], f"{1e3 * r['stage_time']:g}", r["profile"], r["micro_batches"], f"`{r['schedule']}`",
             f"{1e3 * r['t_ours_s']:.0f}", f"{1e3 * r['t_ideal_s']:.0f}", f"{r['efficiency']:.3f}",
             _or_dash(r["t_peer_s"], lambda t: f"{1e3 * t:.0f}"), _or_dash(r["peer_efficiency"], "{:.3f}".format),
             _or_dash(r["ours_over_peer"], "{:.3f}".format), f"{r['ours_over_gpipe']:.3f}",
             f"{r['ideal_over_gpipe']:.3f}", f"{r['held_at_peak']:g}",
             _or_dash(r["gap_median_s"], lambda t: f"{1e3 * t:.2f}"), f"{1e3 * r['cpu_ours_s']:.0f}",
             _or_dash(r["cpu_over_peer"], "{:.2f}".format)]
            for r in rows
        ],
    )
    return (
        "Blocks of `lightning_pipe.testing.emulate` (F, I, W: waits), 4 per stage, one micro-batch's activation"
        f" {ROWS} × {WIDTH} floats; `checkpoint=\"never\"`; median of {rounds} steps after {warmup} warm-up, the"
        " configurations taking turns step by step. F=I=W is each stage's time per micro-batch; profiles: `uniform`,"
        " `heavy_last` (the last stage's blocks twice as heavy), `weight_heavy` (W = 2I). *ideal* is the step of the"
        " schedule's own tick table (`schedules.planner.predict` with these costs per chunk, messages free); *efficiency* is ideal"
        " / measured. *held at peak*: the most micro-batches' activations a stage holds at once, from the tick table"
        " (in whole-stage units). *gap per action*: the median, over the stages of one traced step, of the time from"
        " one compute's end to the next one's start when no message is waited for (the runtime's own cost per"
        " action). *CPU per step*: the CPU time of all the ranks' processes in one step (median per rank, summed):"
        " the waits take none, so it is the runtimes' own work, and where there are more processes than cores it is"
        " what they contend for; our configurations share one set of process groups (each gloo group's threads wake"
        " up while idle, which would add their CPU to every step, ours and torch's alike). Torch's counterpart runs"
        " the same schedule's class on the same blocks (none for `gpipe_split`).\n\n"
        f"{table}\n\n" + _targets(rows, gaps)
    )


def _targets(rows: list[dict[str, Any]], gaps: list[float]) -> str:
    lines = []
    for s, least in ((4, 0.95), (8, 0.90)):
        long = [r for r in rows if r["num_stages"] == s and r["stage_time"] >= LONG]
        if long:
            worst = min(long, key=lambda r: r["efficiency"])
            lines.append(verdict(
                f"with {1e3 * worst['stage_time']:g} ms per stage, every schedule ≥ {least} of its ideal at S={s}"
                f" (worst `{worst['schedule']}`, M={worst['micro_batches']})",
                worst["efficiency"] >= least, f"{worst['efficiency']:.3f}",
            ))
        elif any(r["num_stages"] == s for r in rows):
            lines.append(f"{s} stages with 50 ms or more per stage: not measured (the run was trimmed to fit).")
    short = [r for r in rows if r["stage_time"] < LONG and r["peer_efficiency"] is not None]
    if short:
        worst = max(short, key=lambda r: r["peer_efficiency"] - r["efficiency"])
        lines.append(verdict(
            "at short times, every schedule at least as efficient as torch's (worst"
            f" `{worst['schedule']}`, S={worst['num_stages']}, {worst['profile']}, M={worst['micro_batches']};"
            " ours / torch's efficiency)", worst["efficiency"] >= worst["peer_efficiency"],
            f"{worst['efficiency'] / worst['peer_efficiency']:.3f}",
        ))
    peers = [r for r in rows if r["ours_over_peer"] is not None]
    if peers:
        worst = max(peers, key=lambda r: r["ours_over_peer"])
        lines.append(verdict(
            f"every schedule ≤ 1.00 × torch's counterpart (worst `{worst['schedule']}`, S={worst['num_stages']},"
            f" {worst['profile']}, M={worst['micro_batches']})", worst["ours_over_peer"] <= 1.0,
            f"{worst['ours_over_peer']:.3f}",
        ))
    groups = {(r["num_stages"], r["stage_time"], r["profile"], r["micro_batches"]) for r in rows}
    short_of = []
    for group in sorted(groups):
        at = [r for r in rows if (r["num_stages"], r["stage_time"], r["profile"], r["micro_batches"]) == group]
        gained = max(1 - r["ours_over_gpipe"] for r in at)
        predicted = max(1 - r["ideal_over_gpipe"] for r in at)
        if gained < 0.8 * predicted:
            short_of.append(f"S={group[0]} {1e3 * group[1]:g} ms {group[2]} M={group[3]}: {gained:.1%} of {predicted:.1%}")
    lines.append(verdict(
        "in every configuration the best schedule beats our gpipe by ≥ 80% of the best gain the tick tables predict",
        not short_of, "; ".join(short_of) if short_of else f"all {len(groups)} configurations",
    ))
    split = [r for r in rows if r["schedule"] == "gpipe_split"]
    slower = [r for r in split if r["ours_over_gpipe"] >= 1.0]
    lines.append(verdict(
        "gpipe with deferred weight gradients beats plain gpipe everywhere",
        not slower, f"{min(r['ours_over_gpipe'] for r in split):.3f} to {max(r['ours_over_gpipe'] for r in split):.3f}",
    ))
    if gaps:
        lines.append(
            f"Runtime's own cost per action (compute end to next compute start, no message waited for), over every"
            f" traced step: median {1e3 * statistics.median(gaps):.2f} ms, 90th percentile"
            f" {1e3 * statistics.quantiles(gaps, n=10)[-1] if len(gaps) > 1 else 1e3 * gaps[0]:.2f} ms, over"
            f" {len(gaps)} gaps."
        )
    compared = [r for r in rows if r["cpu_over_peer"] is not None]
    if compared:
        lowest, highest = (f(compared, key=lambda r: r["cpu_over_peer"]) for f in (min, max))
        lines.append(
            "CPU per step, ours / torch's, all ranks together: median"
            f" {statistics.median(r['cpu_over_peer'] for r in compared):.2f}, from {_cpu_case(lowest)} to"
            f" {_cpu_case(highest)}."
        )
    return "\n".join(lines)


def _cpu_case(row: dict[str, Any]) -> str:
    return (
        f"{row['cpu_over_peer']:.2f} (`{row['schedule']}`, S={row['num_stages']}, {row['profile']},"
        f" M={row['micro_batches']})"
    )


def _or_dash(value: float | None, show: Any) -> str:
    return "-" if value is None else show(value)
