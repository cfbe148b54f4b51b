"""Planner accuracy (emulated): the planner's predicted step against the measured one for every schedule, on emulated
devices at 4 stages; ``schedule="auto"``'s choice measured against the fastest; a memory budget honoured, measured.

The blocks are :mod:`lightning_pipe.testing.emulate`'s (F, I, W: waits), with :mod:`ranks.emulated`'s three cost profiles.
Predictions come the way ``schedule="auto"`` makes them: each block profiled by
:func:`~lightning_pipe.partition.profiling.block_cost_model`, plus the runtime's own costs (per compute action, per
message) measured on this machine first, from three small configurations that the tables do not show (calibration):
the costs with which the planner best meets their measured steps
(:func:`~lightning_pipe.schedules.planner.fitted_runtime_costs`).

Auto's choice is made by :func:`lightning_pipe.auto_schedule.ranked_choice` (the code path of ``schedule="auto"``)
among the measured configurations it may choose (not ``zbv``, nor ``gpipe_split``, which is no schedule name).
Activation memory is measured as tests/test_activation_memory.py measures it: the tensors saved for backward (here
those the blocks save) alive at once, at their peak, by storage, parameters left out.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import Tensor, nn

import ranks.accuracy
from harness.launch import launch
from harness.report import markdown_table, verdict
from harness.summarize import median, median_ratio
from lightning_pipe.auto_schedule import ranked_choice
from lightning_pipe.partition.counts import split_evenly
from lightning_pipe.testing.emulate import emulated_blocks
from lightning_pipe.partition.profiling import block_cost_model
from lightning_pipe.schedules.builtin import SCHEDULES, gpipe_schedule
from lightning_pipe.schedules.choice import AUTO_SCHEDULES, Configuration, CostModel, chunk_costs, size_text
from lightning_pipe.schedules.planner import MeasuredStep, Prediction, RuntimeCosts, fitted_runtime_costs, predict
from lightning_pipe.settings import PipelineSettings
from ranks.emulated import CONFIGURATIONS, PROFILES, block_times

FULL = {"stages": 4, "stage_time": 0.016, "profiles": PROFILES, "micro_batches": (4, 8), "calibration_m": 2,
        "warmup": 1, "rounds": 5}
QUICK = {"stages": 2, "stage_time": 0.004, "profiles": ("uniform",), "micro_batches": (2, 4), "calibration_m": 1,
         "warmup": 0, "rounds": 1}
# On the uniform profile, at calibration_m micro-batches: few large actions, many small ones, and split backward.
CALIBRATION = ("gpipe", "interleaved_1f1b_v4", "zero_bubble")
WIDTH, ROWS = 1024, 128  # the batch, whatever M: ROWS x WIDTH floats (512 KiB); one block's activation is its input
WITHIN, NEAR = 0.10, 0.03  # the targets: predicted within 10% of measured; auto's choice within 3% of the fastest


class _Emulated(nn.Module):
    """A model whose whole forward is the emulated blocks, for profiling them as ``schedule="auto"`` does."""

    def __init__(self, blocks: nn.Sequential) -> None:
        super().__init__()
        self.blocks = blocks

    def forward(self, x: Tensor) -> Tensor:
        return self.blocks(x)


def run(quick: bool) -> dict[str, Any]:
    spec = QUICK if quick else FULL
    s, stage_time, ms = spec["stages"], spec["stage_time"], spec["micro_batches"]
    calibration = [("uniform", spec["calibration_m"], name) for name in CALIBRATION]
    runs = calibration + [(p, m, name) for p in spec["profiles"] for m in ms for name in CONFIGURATIONS]
    load = os.getloadavg()[0]
    models = {p: _profiled(p, s, stage_time, [spec["calibration_m"], *ms]) for p in spec["profiles"]}
    answers = launch(ranks.accuracy.measure, s, {
        "stage_time": stage_time, "width": WIDTH, "rows": ROWS, "runs": runs, "warmup": spec["warmup"],
        "rounds": spec["rounds"],
    }, timeout=1800)
    load = max(load, os.getloadavg()[0])
    times = answers[0]["times"]
    runtime = _calibrated(answers, models["uniform"], s, calibration)
    rows = []
    for profile, m, name in runs[len(calibration):]:
        key = f"{profile}/{m}/{name}"
        ideal, planned = (_prediction(models[profile], name, s, m, r) for r in (RuntimeCosts(), runtime))
        own = _runtime_per_action(answers, key, ideal)
        rows.append({
            "profile": profile, "micro_batches": m, "schedule": name, "t_measured_s": median(times[key]),
            "t_ideal_s": ideal.step, "t_predicted_s": planned.step, "ratio": planned.step / median(times[key]),
            "own_per_action_s": own, "peak_predicted_bytes": max(planned.peak_activation_bytes),
            "peak_measured_bytes": max(a["peak_bytes"][key] for a in answers),
        })
    choices = [_auto(models[p], p, s, ms, times, answers, runtime) for p in spec["profiles"]]
    markdown = _markdown(rows, choices, runtime, spec, load)
    return {"title": "Planner accuracy (emulated)", "markdown": markdown,
            "data": {"rows": rows, "choices": choices, "runtime": vars(runtime), "load_average": load}}


def _profiled(profile: str, num_stages: int, stage_time: float, counts: list[int]) -> CostModel:
    """The profile's blocks measured as ``schedule="auto"`` measures them, at the smallest and largest micro-batch,
    on one compute thread as each rank has (several threads on a loaded machine wait for each other's cores)."""
    torch.manual_seed(0)
    module = _Emulated(emulated_blocks(WIDTH, block_times(profile, num_stages, stage_time)))
    sizes = (max(1, ROWS // max(counts)), max(1, ROWS // min(counts)))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return block_cost_model(module, module.blocks, torch.randn(ROWS, WIDTH), torch.device("cpu"), sizes)
    finally:
        torch.set_num_threads(threads)


def _prediction(model: CostModel, name: str, num_stages: int, m: int, runtime: RuntimeCosts) -> Prediction:
    """The planner's prediction for configuration ``name`` at ``m`` micro-batches, as ``plan_configuration`` makes
    it (blocks split evenly into chunks, as the benchmark's stages are)."""
    schedule_name, v = CONFIGURATIONS[name]
    schedule = gpipe_schedule(split_backward=True) if schedule_name == "gpipe_split" else SCHEDULES[schedule_name]
    chunks = chunk_costs(model.at(ROWS / m), split_evenly(model.num_blocks, num_stages * v))
    return predict(schedule, num_stages, m, chunks, v, runtime.send_time, action_time=runtime.action_time)


def _runtime_per_action(answers: list[dict[str, Any]], key: str, ideal: Prediction) -> float | None:
    """Seconds the runtime spent per compute action in ``key``'s traced step: every stage's busy time outside
    message waits, less its computes' predicted times, over its compute actions."""
    busy = [sum(a.end - a.start for a in stage) for stage in ideal.simulation.intervals]
    spent = sum(a["own"][key][0] - busy[a["stage"]] for a in answers)
    count = sum(a["own"][key][1] for a in answers)
    return spent / count if count else None


def _calibrated(answers: list[dict[str, Any]], model: CostModel, num_stages: int, runs: list[tuple]) -> RuntimeCosts:
    """The runtime's costs on this machine: those with which the planner best meets the calibration steps."""
    steps = []
    for profile, m, name in runs:
        schedule_name, v = CONFIGURATIONS[name]
        schedule = gpipe_schedule(split_backward=True) if schedule_name == "gpipe_split" else SCHEDULES[schedule_name]
        chunks = chunk_costs(model.at(ROWS / m), split_evenly(model.num_blocks, num_stages * v))
        steps.append(MeasuredStep(median(answers[0]["times"][f"{profile}/{m}/{name}"]), schedule, num_stages, m, chunks, v))
    return fitted_runtime_costs(steps)


def _auto(
    model: CostModel, profile: str, num_stages: int, ms: tuple[int, ...], times: dict[str, list[float]],
    answers: list[dict[str, Any]], runtime: RuntimeCosts,
) -> dict[str, Any]:
    """``schedule="auto"``'s choice among the measured configurations it may choose, without a budget and under one
    that excludes it, each measured."""
    names = {(schedule, v): name for name, (schedule, v) in CONFIGURATIONS.items() if schedule in AUTO_SCHEDULES}
    candidates = [Configuration(schedule, m, v, "never") for m in ms for (schedule, v) in names]
    settings = PipelineSettings(schedule="auto")

    def key(c: Configuration) -> str:
        return f"{profile}/{c.num_micro_batches}/{names[(c.schedule, c.virtual_stages)]}"

    def memory(c: Configuration) -> int:  # the most any rank held: its parameters and their gradients, activations
        return max(2 * a["parameter_bytes"] + a["peak_bytes"][key(c)] for a in answers)

    rows, chosen, _ = ranked_choice(model, settings, num_stages, ROWS, None, candidates, "profiled", runtime=runtime)
    fastest = min(candidates, key=lambda c: median(times[key(c)]))
    overall = min((k for k in times if k.startswith(f"{profile}/") and int(k.split("/")[1]) in ms),
                  key=lambda k: median(times[k]))
    least = min(r.memory_bytes for r in rows)
    result = {
        "profile": profile, "chosen": str(chosen.configuration), "chosen_key": key(chosen.configuration),
        "t_chosen_s": median(times[key(chosen.configuration)]), "fastest": str(fastest),
        "t_fastest_s": median(times[key(fastest)]),
        "chosen_over_fastest": median_ratio(times[key(chosen.configuration)], times[key(fastest)]),
        "overall_fastest": overall, "t_overall_fastest_s": median(times[overall]),
    }
    if chosen.memory_bytes > least:  # a budget halfway down to the least any candidate needs excludes the choice
        budget = (chosen.memory_bytes + least) / 2
        _, limited, _ = ranked_choice(model, settings, num_stages, ROWS, budget, candidates, "profiled", runtime=runtime)
        fitting = [r.configuration for r in rows if memory(r.configuration) <= budget]
        result.update({
            "budget_bytes": budget, "limited": str(limited.configuration),
            "limited_predicted_bytes": limited.memory_bytes, "limited_measured_bytes": memory(limited.configuration),
            "t_limited_s": median(times[key(limited.configuration)]),
            "t_fastest_fitting_s": min((median(times[key(c)]) for c in fitting), default=None),
        })
    return result


def _markdown(rows: list[dict[str, Any]], choices: list[dict[str, Any]], runtime: RuntimeCosts, spec: dict[str, Any],
              load: float) -> str:
    table = markdown_table(
        ["profile", "M", "schedule", "ideal (ms)", "predicted (ms)", "measured (ms)", "predicted / measured",
         "within 10%", "runtime's own per action, this row (ms)", "peak activations predicted / measured (KiB)"],
        [
            [r["profile"], r["micro_batches"], f"`{r['schedule']}`", f"{1e3 * r['t_ideal_s']:.0f}",
             f"{1e3 * r['t_predicted_s']:.0f}", f"{1e3 * r['t_measured_s']:.0f}", f"{r['ratio']:.3f}",
             "holds" if abs(r["ratio"] - 1) <= WITHIN else "does not hold",
             _milliseconds(r["own_per_action_s"]),
             f"{r['peak_predicted_bytes'] / 1024:.0f} / {r['peak_measured_bytes'] / 1024:.0f}"]
            for r in rows
        ],
    )
    auto = markdown_table(
        ["profile", "auto's choice", "its step (ms)", "fastest auto may choose", "its step (ms)", "choice / fastest",
         "fastest of all (ms)"],
        [[c["profile"], f"`{c['chosen']}`", f"{1e3 * c['t_chosen_s']:.0f}", f"`{c['fastest']}`",
          f"{1e3 * c['t_fastest_s']:.0f}", f"{c['chosen_over_fastest']:.3f}",
          f"`{c['overall_fastest'].split('/', 2)[2]}` (M={c['overall_fastest'].split('/')[1]}):"
          f" {1e3 * c['t_overall_fastest_s']:.0f}"] for c in choices],
    )
    limited = [c for c in choices if "budget_bytes" in c]
    budgets = markdown_table(
        ["profile", "memory budget", "choice under it", "predicted memory", "measured memory", "its step (ms)",
         "fastest fitting, measured (ms)"],
        [[c["profile"], size_text(c["budget_bytes"]), f"`{c['limited']}`", size_text(c["limited_predicted_bytes"]),
          size_text(c["limited_measured_bytes"]), f"{1e3 * c['t_limited_s']:.0f}",
          "-" if c["t_fastest_fitting_s"] is None else f"{1e3 * c['t_fastest_fitting_s']:.0f}"] for c in limited],
    )
    lines = []
    for profile in spec["profiles"]:
        at = [r for r in rows if r["profile"] == profile]
        worst = max(at, key=lambda r: abs(r["ratio"] - 1))
        lines.append(verdict(
            f"{profile}: every schedule's predicted step within 10% of the measured one (worst `{worst['schedule']}`,"
            f" M={worst['micro_batches']}; load average {load:.1f})", abs(worst["ratio"] - 1) <= WITHIN,
            f"{worst['ratio']:.3f}",
        ))
    missed = [r for r in rows if abs(r["ratio"] - 1) > WITHIN]
    if missed:
        lines.append(
            "Where the prediction misses, the row's own runtime cost per action (from its traced step) beside the"
            f" calibrated {1e3 * runtime.action_time:.2f} ms: more means the runtime's per-action cost, no more means"
            " time lost waiting for messages or to the machine's load: " + "; ".join(
                f"{r['profile']} `{r['schedule']}` M={r['micro_batches']}: {r['ratio']:.3f},"
                f" {_milliseconds(r['own_per_action_s'])} ms"
                for r in missed
            ) + "."
        )
    for c in choices:
        lines.append(verdict(
            f"{c['profile']}: auto's choice ({c['chosen']}) within 3% of the fastest it may choose, measured (load"
            f" average {load:.1f})", c["chosen_over_fastest"] <= 1 + NEAR, f"{c['chosen_over_fastest']:.3f}",
        ))
    for c in choices:
        if "budget_bytes" not in c:
            lines.append(f"{c['profile']}: auto's choice needs the least memory of any candidate; no budget excludes it.")
    for c in limited:
        lines.append(verdict(
            f"{c['profile']}: under a budget of {size_text(c['budget_bytes'])}, which excludes the fastest, the"
            f" choice ({c['limited']}) fits, measured (load average {load:.1f})",
            c["limited_measured_bytes"] <= c["budget_bytes"], size_text(c["limited_measured_bytes"]),
        ))
    return (
        f"S={spec['stages']}, blocks of `lightning_pipe.testing.emulate` (F, I, W: waits), 4 per stage, F=I=W"
        f" {1e3 * spec['stage_time']:g} ms per stage and micro-batch (profiles as in *Schedules at scale*); a batch of"
        f" {ROWS} × {WIDTH} floats split into M micro-batches; `checkpoint=\"never\"`; median of {spec['rounds']}"
        f" steps after {spec['warmup']} warm-up, the configurations taking turns step by step. *ideal*: the tick table"
        " with the blocks' profiled costs, messages and runtime free; *predicted*: the same plus the runtime's costs"
        f" calibrated on this machine first ({runtime}; from {', '.join(CALIBRATION)} at"
        f" M={spec['calibration_m']}, uniform, not in the table: the costs with which the planner best meets their"
        " measured steps). *runtime's own per action, this row*: measured"
        " from one traced step (busy time outside message waits, less the profiled computes, per compute). *peak"
        " activations*: the most any stage holds, predicted from the profile and measured (tensors the blocks save"
        " for backward, alive at once).\n\n"
        f"{table}\n\n`schedule=\"auto\"` (its `ranked_choice`, on the profiled blocks and the calibrated runtime)"
        " among the measured configurations it may choose; *fastest of all* includes `zbv` and `gpipe_split`, which"
        f" it does not choose:\n\n{auto}\n\nUnder a memory budget halfway between what auto's choice needs and the"
        " least any candidate needs (a stage's parameters and their gradients, and its peak activations), the choice and"
        f" what its most loaded stage held, measured:\n\n{budgets}\n\n" + "\n".join(lines)
    )


def _milliseconds(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.2f}"
