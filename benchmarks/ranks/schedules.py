"""One rank of the schedules section: each of lightning_pipe's schedules beside torch.distributed.pipelining's same
schedule, in one launch.

Every configuration takes one step per round, in turn (see :mod:`ranks.speed`). The peer runs its own schedule
classes on ``PipelineStage`` s of the same layers, placed as its schedule expects (one stage per rank; several in a
loop for the interleaved schedules; a V for ZB-V), with a per-micro-batch MSE loss; ours run the same split through
:class:`engine_step.EngineStep`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleZBVZeroBubble,
)

from harness.rank import run_rank
from harness.stack import make_batch, make_stack
from harness.timing import in_turns, timed
from harness.workload import Workload
from lightning_pipe.partition.counts import PipelineParallelConfig
from lightning_pipe.schedules.builtin import SCHEDULES, gpipe_schedule
from ranks.engine_step import EngineStep

# Ours -> the peer's schedule class, and whether it takes a list of stages per rank.
PEERS: dict[str, tuple[type, bool]] = {
    "gpipe": (ScheduleGPipe, False),
    "1f1b": (Schedule1F1B, False),
    "interleaved_1f1b": (ScheduleInterleaved1F1B, True),
    "zero_bubble": (ScheduleInterleavedZeroBubble, True),
    "zbv": (ScheduleZBVZeroBubble, True),
}
OURS_ONLY = ("gpipe_split",)  # GPipe with deferred weight gradients: no peer


class PeerSchedule:
    """This rank's stages of ``sequential`` on torch.distributed.pipelining, placed as ``name``'s schedule places
    them, and its training step."""

    def __init__(
        self, name: str, sequential: nn.Sequential, num_micro_batches: int, group: dist.ProcessGroup,
        virtual_stages: int | None = None,
    ) -> None:
        schedule = SCHEDULES[name]
        num_stages, rank = dist.get_world_size(group), dist.get_rank(group)
        v = schedule.checked_virtual_stages(virtual_stages)
        ranges = PipelineParallelConfig(num_stages * v, num_micro_batches).split_into_stages(len(sequential))
        device = next(sequential.parameters()).device
        chunks = schedule.chunks(rank, num_stages, v)
        stages = [
            PipelineStage(nn.Sequential(*(sequential[i] for i in ranges[k])), k, num_stages * v, device, group=group)
            for k in chunks
        ]
        kind, takes_list = PEERS[name]
        self.schedule = kind(stages if takes_list else stages[0], num_micro_batches, loss_fn=F.mse_loss)
        self.has_first = 0 in chunks
        self.has_last = num_stages * v - 1 in chunks

    def step(self, x: Tensor, target: Tensor) -> None:
        args = (x,) if self.has_first else ()
        if self.has_last:
            self.schedule.step(*args, target=target)
        else:
            self.schedule.step(*args)


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Step times (seconds) per configuration, one per measured round, identical on every rank."""
    work = Workload.from_spec(spec)
    world = dist.group.WORLD
    x, target = make_batch(work)
    timers: dict[str, Callable[[], float]] = {}  # how to time one step of each configuration, by name
    for m in spec["micro_batches"]:
        for name in [*PEERS, *OURS_ONLY]:
            schedule = gpipe_schedule(split_backward=True) if name == "gpipe_split" else name
            ours = EngineStep(make_stack(work), m, "never", schedule=schedule)
            timers[f"ours/{name}/{m}"] = lambda step=ours.step: timed(lambda: step(x, target), world)
            if name in PEERS:
                theirs = PeerSchedule(name, make_stack(work), m, world)
                timers[f"peer/{name}/{m}"] = lambda step=theirs.step: timed(lambda: step(x, target), world)
    return in_turns(timers, work.warmup, work.rounds)


if __name__ == "__main__":
    run_rank(measure)
