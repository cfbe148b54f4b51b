"""One rank of the planner accuracy section: every schedule's step on emulated blocks (:mod:`lightning_pipe.testing.emulate`),
timed in turns, and for each configuration one traced step (the runtime's own time per action) and one step
counting the activations the blocks save for backward (their peak on this stage).

The batch is the same whatever the micro-batch count (``rows`` x ``width``), as under ``schedule="auto"``, which
splits the training batch it is given. Unlike :mod:`ranks.emulated`, no torch.distributed.pipelining peer runs.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from harness.rank import run_rank
from harness.timing import in_turns, timed
from lightning_pipe.testing.emulate import emulated_blocks
from lightning_pipe.schedules.builtin import gpipe_schedule
from lightning_pipe.trace.timeline import BACKWARD, FORWARD, WAIT, StepTimeline
from ranks.emulated import CONFIGURATIONS, block_times
from ranks.engine_step import EngineStep


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Step times (seconds) per ``profile/M/configuration``, one per measured round, identical on every rank; this
    rank's stage, its parameters' bytes, and per configuration its busy time outside message waits with its count of
    compute actions (one traced step), and the peak bytes its blocks saved for backward."""
    world = dist.group.WORLD
    num_stages = dist.get_world_size()
    x = torch.randn(spec["rows"], spec["width"], generator=torch.Generator().manual_seed(1))
    target = torch.zeros_like(x)
    steps: dict[str, tuple[EngineStep, StepTimeline]] = {}
    for profile, m, name in spec["runs"]:
        schedule, v = CONFIGURATIONS[name]
        timeline = StepTimeline(torch.device("cpu"), enabled=False)
        steps[f"{profile}/{m}/{name}"] = EngineStep(
            _model(block_times(profile, num_stages, spec["stage_time"]), spec["width"]), m, "never",
            schedule=gpipe_schedule(split_backward=True) if schedule == "gpipe_split" else schedule,
            virtual_stages=v, timeline=timeline,
        ), timeline
    timers: dict[str, Callable[[], float]] = {
        key: (lambda step=step: timed(lambda: step.step(x, target), world)) for key, (step, _) in steps.items()
    }
    samples = in_turns(timers, spec["warmup"], spec["rounds"])
    own, peaks = {}, {}
    for key, (step, timeline) in steps.items():
        own[key] = _own_time(step, timeline, x, target)
        peaks[key] = _peak_saved(step, x, target)
    any_step = next(iter(steps.values()))[0]
    return {
        "times": samples, "own": own, "peak_bytes": peaks, "stage": any_step.stage.stage_index,
        "parameter_bytes": sum(p.numel() * p.element_size() for p in any_step.stage.parameters()),
    }


def _model(times: list, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return emulated_blocks(width, times)


def _own_time(step: EngineStep, timeline: StepTimeline, x: Tensor, target: Tensor) -> tuple[float, int, float, float]:
    """Of one traced step: seconds from this stage's first compute's start to its last one's end, less the time
    waiting for messages (less the computes' set times, the runtime's own time); the number of computes; and the
    seconds before the first compute and after the last one (the step's own start and end)."""
    timeline.enabled = True
    dist.barrier()
    started = time.perf_counter()
    step.step(x, target)
    ended = time.perf_counter()
    timeline.enabled = False
    intervals = timeline.intervals()
    computes = [i for i in intervals if i.kind in (FORWARD, BACKWARD)]
    if not computes:
        return 0.0, 0, 0.0, 0.0
    begin, end = min(i.start for i in computes), max(i.end for i in computes)
    waited = sum(max(0.0, min(i.end, end) - max(i.start, begin)) for i in intervals if i.kind == WAIT)
    return end - begin - waited, len(computes), begin - started, ended - end


def _peak_saved(step: EngineStep, x: Tensor, target: Tensor) -> int:
    """The most bytes the stage's blocks had saved for backward and still alive at once, over one step (counted by
    storage, parameters left out): what the planner's activation bytes predict (the loss's own are not counted)."""
    parameters = {p.untyped_storage().data_ptr() for p in step.stage.parameters()}
    alive: dict[int, tuple[weakref.ref, int]] = {}
    inside = [0]
    peak = [0]

    def pack(tensor: Tensor) -> Tensor:
        storage = tensor.untyped_storage()
        if inside[0] and storage.data_ptr() not in parameters and storage.nbytes():
            alive[storage.data_ptr()] = (weakref.ref(tensor), storage.nbytes())
            for ptr in [p for p, (ref, _) in alive.items() if ref() is None]:
                del alive[ptr]
            peak[0] = max(peak[0], sum(size for _, size in alive.values()))
        return tensor

    with _inside_blocks(step.stage.blocks, inside), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        dist.barrier()
        step.step(x, target)
    return peak[0]


@contextmanager
def _inside_blocks(blocks: nn.Module, depth: list[int]) -> Iterator[None]:
    """``depth[0]`` above 0 while one of ``blocks`` runs its forward."""
    def enter(*_: Any) -> None:
        depth[0] += 1

    def leave(*_: Any) -> None:
        depth[0] -= 1

    handles = [h for block in blocks for h in (block.register_forward_pre_hook(enter), block.register_forward_hook(leave))]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


if __name__ == "__main__":
    run_rank(measure)
