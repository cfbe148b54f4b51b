"""One rank of the emulated schedules section: every schedule of ours beside torch.distributed.pipelining's on the same
emulated blocks (:mod:`lightning_pipe.testing.emulate`), for each cost profile and micro-batch count, in one launch.

Configurations take one step each per round, in turn (see :func:`harness.timing.in_turns`). After the timed rounds
each of our configurations runs one more step with its timeline on, for the runtime's own cost per action.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from harness.rank import run_rank
from harness.timing import in_turns, timed
from lightning_pipe.testing.emulate import BlockTimes, emulated_blocks
from lightning_pipe.schedules.builtin import gpipe_schedule
from lightning_pipe.trace.timeline import BACKWARD, FORWARD, WAIT, StepTimeline
from ranks.engine_step import EngineStep
from ranks.schedules import PEERS, PeerSchedule

BLOCKS_PER_STAGE = 4  # enough for 4 chunks per stage (interleaved_1f1b with v = 4)
# Each of ours: (schedule, chunks per stage), by the name the tables show; the peer runs the same schedule's class.
CONFIGURATIONS: dict[str, tuple[str, int]] = {
    "gpipe": ("gpipe", 1),
    "gpipe_split": ("gpipe_split", 1),
    "1f1b": ("1f1b", 1),
    "interleaved_1f1b_v2": ("interleaved_1f1b", 2),
    "interleaved_1f1b_v4": ("interleaved_1f1b", 4),
    "zero_bubble": ("zero_bubble", 1),
    "zbv": ("zbv", 2),
}
PROFILES = ("uniform", "heavy_last", "weight_heavy")


def block_times(profile: str, num_stages: int, stage_time: float) -> list[BlockTimes]:
    """Each block's times under ``profile``, ``stage_time`` seconds per stage and micro-batch for each of F, I, W:
    ``uniform`` (F = I = W), ``heavy_last`` (the last stage's blocks twice as heavy: a head and a loss),
    ``weight_heavy`` (W = 2I)."""
    t = stage_time / BLOCKS_PER_STAGE
    even = BlockTimes(forward=t, input_gradient=t, weight_gradient=t)
    if profile == "uniform":
        return [even] * (BLOCKS_PER_STAGE * num_stages)
    if profile == "heavy_last":
        return [even] * (BLOCKS_PER_STAGE * (num_stages - 1)) + [even.scaled(2)] * BLOCKS_PER_STAGE
    if profile == "weight_heavy":
        return [BlockTimes(forward=t, input_gradient=t, weight_gradient=2 * t)] * (BLOCKS_PER_STAGE * num_stages)
    raise ValueError(f"profile {profile!r}: one of {PROFILES}")


def _gaps(timeline: StepTimeline) -> list[float]:
    """Seconds from each compute's end to the next compute's start on this stage, where no wait for a message lies
    between them: the runtime's own cost per action."""
    gaps, previous_end, waited = [], None, False
    for interval in sorted(timeline.intervals(), key=lambda i: i.start):
        if interval.kind == WAIT:
            waited = True
        elif interval.kind in (FORWARD, BACKWARD):
            if previous_end is not None and not waited:
                gaps.append(interval.start - previous_end)
            previous_end, waited = interval.end, False
    return gaps


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Step times (seconds) per ``profile/M/configuration`` (``ours/...`` and ``peer/...``), one per measured round,
    identical on every rank; and this rank's gaps between computes (one traced step of each of ours)."""
    world = dist.group.WORLD
    num_stages = dist.get_world_size()
    timers: dict[str, Callable[[], float]] = {}
    traced: dict[str, Callable[[], list[float]]] = {}
    cpu: dict[str, list[float]] = defaultdict(list)  # this rank's CPU seconds per step, by timer
    for profile in spec["profiles"]:
        times = block_times(profile, num_stages, spec["stage_time"])
        for m in spec["micro_batches"]:
            x = torch.randn(m * spec["rows"], spec["width"], generator=torch.Generator().manual_seed(1))
            target = torch.zeros_like(x)
            for name in spec["configurations"]:
                schedule, v = CONFIGURATIONS[name]
                key = f"{profile}/{m}/{name}"
                timeline = StepTimeline(torch.device("cpu"), enabled=False)
                ours = EngineStep(
                    _model(times, spec["width"]), m, "never",
                    schedule=gpipe_schedule(split_backward=True) if schedule == "gpipe_split" else schedule,
                    virtual_stages=v, timeline=timeline,
                )
                timers[f"ours/{key}"] = _timer(lambda step=ours.step: step(x, target), world, cpu[f"ours/{key}"])
                traced[key] = lambda step=ours.step, timeline=timeline: _traced(step, timeline, x, target)
                if schedule in PEERS:
                    theirs = PeerSchedule(schedule, _model(times, spec["width"]), m, world, virtual_stages=v)
                    timers[f"peer/{key}"] = _timer(lambda step=theirs.step: step(x, target), world, cpu[f"peer/{key}"])
    samples = in_turns(timers, spec["warmup"], spec["rounds"])
    return {
        "times": samples, "gaps": {key: trace() for key, trace in traced.items()},
        "cpu": {key: seconds[spec["warmup"]:] for key, seconds in cpu.items()},
    }


def _timer(step: Callable[[], None], group: dist.ProcessGroup, cpu: list[float]) -> Callable[[], float]:
    """Times one step on the slowest rank (:func:`timed`), and adds this process's CPU seconds in it to ``cpu``: the
    emulated blocks' waits take none, so it is the runtime's own cost, which the machine's other processes share."""

    def time_one() -> float:
        start = time.process_time()
        elapsed = timed(step, group)
        cpu.append(time.process_time() - start)
        return elapsed

    return time_one


def cpu_per_step(spec: dict[str, Any]) -> dict[str, dict[str, list[float]]]:
    """This rank's CPU seconds per step of one schedule, ours and torch's taking turns step by step on the same
    emulated blocks (uniform, ``spec["stage_time"]`` per stage): the whole process's (``time.process_time``, as the
    section measures) and its main thread's (``time.thread_time``, without gloo's threads), after a warm-up."""
    world = dist.group.WORLD
    times = block_times("uniform", dist.get_world_size(), spec["stage_time"])
    m, (schedule, v) = spec["micro_batches"], CONFIGURATIONS[spec["configuration"]]
    x = torch.randn(m * spec["rows"], spec["width"], generator=torch.Generator().manual_seed(1))
    target = torch.zeros_like(x)
    ours = EngineStep(_model(times, spec["width"]), m, "never", schedule=schedule, virtual_stages=v)
    theirs = PeerSchedule(schedule, _model(times, spec["width"]), m, world, virtual_stages=v)
    steps = {"ours": ours.step, "peer": theirs.step}
    cpu: dict[str, dict[str, list[float]]] = {name: {"process": [], "thread": []} for name in steps}
    for round_index in range(spec["warmup"] + spec["rounds"]):
        for name, step in steps.items():
            dist.barrier()
            process, thread = time.process_time(), time.thread_time()
            step(x, target)
            if round_index >= spec["warmup"]:
                cpu[name]["process"].append(time.process_time() - process)
                cpu[name]["thread"].append(time.thread_time() - thread)
    return cpu


def _model(times: list[BlockTimes], width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return emulated_blocks(width, times)


def _traced(step: Callable[[Tensor, Tensor], None], timeline: StepTimeline, x: Tensor, target: Tensor) -> list[float]:
    timeline.enabled = True
    dist.barrier()
    step(x, target)
    timeline.enabled = False
    return _gaps(timeline)


if __name__ == "__main__":
    run_rank(measure, cpu_per_step)
