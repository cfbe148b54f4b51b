"""Timing steps that span several processes: every rank starts together, a step lasts until its slowest rank ends."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist


def timed(step: Callable[[], object], group: dist.ProcessGroup | None = None) -> float:
    """Seconds one call of ``step`` takes on the slowest rank of ``group``, all ranks starting together."""
    dist.barrier(group=group)
    start = time.perf_counter()
    step()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return float(elapsed)


def timed_on(rank: int, step: Callable[[], object]) -> float:
    """Seconds ``step`` takes on ``rank`` alone while the other ranks wait (a one-process reference)."""
    dist.barrier()
    elapsed = torch.zeros(1, dtype=torch.float64)
    if dist.get_rank() == rank:
        start = time.perf_counter()
        step()
        elapsed[0] = time.perf_counter() - start
    dist.broadcast(elapsed, src=rank)
    return float(elapsed)
