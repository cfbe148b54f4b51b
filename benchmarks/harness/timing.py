"""Timing steps that span several processes (every rank starts together, a step lasts until its slowest rank ends),
and timing a ``Trainer``'s steps from the intervals between their ends."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer

if TYPE_CHECKING:
    from lightning_pipe.trace.tracer import StepObservation


def timed(step: Callable[[], object], group: dist.ProcessGroup | None = None) -> float:
    """Seconds one call of ``step`` takes on the slowest rank of ``group``, all ranks starting together."""
    dist.barrier(group=group)
    start = time.perf_counter()
    step()
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return float(elapsed)


def in_turns(timers: dict[str, Callable[[], float]], warmup: int, rounds: int) -> dict[str, list[float]]:
    """Each timer called once per round, the configurations taking turns step by step (so that the machine's load
    falls on all of them alike); the seconds of each after ``warmup`` rounds, by name."""
    samples: dict[str, list[float]] = {name: [] for name in timers}
    for round_index in range(warmup + rounds):
        for name, time_one in timers.items():
            elapsed = time_one()
            if round_index >= warmup:
                samples[name].append(elapsed)
    return samples


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


def step_intervals(ends: list[float]) -> list[float]:
    """Times between consecutive step ends, without the first step (a run's first step is a warm-up)."""
    return [later - earlier for earlier, later in zip(ends[1:], ends[2:])]


def measuring_trainer(strategy: Any, steps: int, clock: Callback) -> Trainer:
    """A ``Trainer`` on every rank of the default group that runs ``steps`` training steps and nothing else
    (no validation, logging, checkpoints or progress bar), timed by ``clock``."""
    return Trainer(
        strategy=strategy, accelerator="cpu", devices=dist.get_world_size(), max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, callbacks=[clock],
    )


class StepEnds(Callback):
    """When each training step ended, and what the strategy observed of it (its bubble, each stage's busy time) at
    the steps it observes: those logged (``log_every_n_steps``) or traced."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.cpu_times: list[float] = []  # this process's CPU time (every thread's) at each step's end
        self.observed: list[StepObservation] = []

    def on_train_batch_end(self, trainer: Trainer, *args: Any, **kwargs: Any) -> None:
        self.times.append(time.perf_counter())
        self.cpu_times.append(time.process_time())
        observed = getattr(trainer.strategy, "last_observed_step", None)
        if observed is not None and (not self.observed or observed is not self.observed[-1]):
            self.observed.append(observed)

    def intervals(self) -> list[float]:
        """The step times of the fit: :func:`step_intervals` of the step ends."""
        return step_intervals(self.times)
