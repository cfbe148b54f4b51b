"""Watching the pipeline during training: every stage's timeline of a step on one clock, the bubble sent to the
loggers, and the steps that ``trace_steps`` names written as a Chrome trace.

Gathering a step's timeline from every stage is a collective over the pipeline, so it happens only for the training
steps that Lightning logs (every ``log_every_n_steps``, as its own monitors do) or that ``trace_steps`` names.

Clocks: every rank measures time on the clock of the pipeline group's first rank (:func:`align_clocks`): exactly on
one host, where processes share one monotonic clock, and to within half a network round trip across hosts.
"""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_pipe.schedules import simulator
from lightning_pipe.schedules.builtin import SCHEDULES
from lightning_pipe.trace.chrome import TracedStep, write_chrome_trace
from lightning_pipe.trace.timeline import FORWARD, Interval, StageExtent, StepTimeline, bubble_fraction, stage_extent

TRACE_FILE_NAME = "gpipe_trace.json"


def align_clocks(group: dist.ProcessGroup | None, rounds: int = 8) -> float:
    """What this rank subtracts from its ``time.perf_counter()`` to read the clock every rank of ``group`` shares.

    The shared clock is the group's first rank's, started at a broadcast. Processes on one host read one monotonic
    clock, so there nothing is estimated and traces line up exactly. A rank on another host estimates its offset
    from the first rank's clock NTP-style: ``rounds`` ping-pongs, keeping the one with the shortest round trip,
    whose midpoint is off by at most half that round trip.
    """
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    reference, me = ranks[0], dist.get_rank()
    hosts: list[Any] = [None] * len(ranks)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    offset = 0.0  # the reference's clock minus this rank's clock
    for peer, host in zip(ranks[1:], hosts[1:]):
        if host == hosts[0] or me not in (reference, peer):
            continue
        best_round_trip = math.inf
        for _ in range(rounds):
            stamp = torch.zeros(1, dtype=torch.float64)
            if me == peer:
                sent = time.perf_counter()
                dist.send(stamp, reference, group=group)
                dist.recv(stamp, reference, group=group)
                received = time.perf_counter()
                if received - sent < best_round_trip:
                    best_round_trip, offset = received - sent, float(stamp) - (sent + received) / 2
            else:
                dist.recv(stamp, peer, group=group)
                stamp[0] = time.perf_counter()
                dist.send(stamp, peer, group=group)
    origin = torch.tensor([time.perf_counter()], dtype=torch.float64)
    dist.broadcast(origin, reference, group=group)
    return float(origin) - offset


@dataclass(frozen=True)
class StepObservation:
    """What the pipeline learned about one training step, the same on every stage."""

    step: int
    bubble_fraction: float
    ideal_bubble_fraction: float
    busy_seconds: list[float]  # per stage, in stage order: time spent in forwards and backwards


class PipelineTracer:
    """Gathers each step's timeline from the stages of one pipeline; the bubble metric, and the trace file.

    Every stage calls :meth:`observe` after its backward (a collective over the pipeline's CPU group). The rank given
    a ``trace_path`` keeps the traced steps and rewrites the trace file after each, so that it exists even if training
    stops early; it says where the file is when it first writes it.
    """

    def __init__(
        self,
        timeline: StepTimeline,
        group: dist.ProcessGroup | None,
        stage: int,
        num_stages: int,
        rank: int,
        trace_steps: Sequence[int] = (),
        trace_path: Path | None = None,
        ideal_bubble: Callable[[int], float] | None = None,
    ) -> None:
        self.timeline = timeline
        # The schedule's idle share for a step of that many micro-batches (by default GPipe's, one chunk per stage).
        self.ideal_bubble = ideal_bubble or (lambda m: simulator.ideal_bubble(SCHEDULES["gpipe"], num_stages, m, 1))
        self.group = group
        self.stage = stage
        self.num_stages = num_stages
        self.rank = rank
        self.trace_steps = frozenset(trace_steps)
        self.trace_path = trace_path  # on the rank that writes the trace; None on the others
        self.traced: list[TracedStep] = []
        self.timeline.offset = align_clocks(group)

    def observe(self, step: int) -> StepObservation | None:
        """The bubble of the step that just ended (``None`` if no stage computed), tracing it if asked to."""
        intervals = self.timeline.intervals()
        extent = stage_extent(intervals)
        num_micro_batches = len({i.micro_batch for i in intervals if i.kind == FORWARD})
        local = [float(self.stage), float(num_micro_batches), *(extent.as_list() if extent else [math.nan] * 3)]
        gathered = [torch.empty(5, dtype=torch.float64) for _ in range(self.num_stages)]
        dist.all_gather(gathered, torch.tensor(local, dtype=torch.float64), group=self.group)
        rows = sorted(tensor.tolist() for tensor in gathered)
        extents = [StageExtent(*row[2:]) for row in rows if not math.isnan(row[2])]
        observation = None
        if extents:
            m = int(max(row[1] for row in rows))
            observation = StepObservation(
                step,
                bubble_fraction(extents),
                self.ideal_bubble(m),
                [0.0 if math.isnan(row[4]) else row[4] for row in rows],
            )
        if step in self.trace_steps and observation is not None:
            self._trace(step, intervals, observation)
        return observation

    def _trace(self, step: int, intervals: list[Interval], observation: StepObservation) -> None:
        holder: list[Any] = [None] * self.num_stages
        dist.all_gather_object(holder, (self.stage, self.rank, intervals), group=self.group)
        if self.trace_path is None:
            return
        by_stage = sorted(holder, key=lambda item: item[0])
        self.traced.append(
            TracedStep(
                step,
                [item[2] for item in by_stage],
                [item[1] for item in by_stage],
                observation.bubble_fraction,
                observation.ideal_bubble_fraction,
            )
        )
        write_chrome_trace(self.trace_path, self.traced)
        if len(self.traced) == 1:
            path = self.trace_path.resolve()
            rank_zero_info(
                f"GPipe: wrote the trace of step {step} to {path} (and of every further step in trace_steps);"
                f" open it in https://ui.perfetto.dev or draw it with"
                f" `lightning-pipe trace render {path} timeline.png`"
            )



def observe_step(tracer: PipelineTracer | None, trainer: Trainer, log_bubble_fraction: bool) -> StepObservation | None:
    """After a training step's backward: gather the stages' timelines when this step is logged (every
    ``log_every_n_steps``, as Lightning's own monitors do) or traced; log the bubble, write the trace. The step's
    observation, or None where it was not observed (or no ``tracer`` keeps timelines)."""
    if tracer is None:
        return None
    step = trainer.global_step
    logging = log_bubble_fraction and bool(trainer.loggers) and trainer._logger_connector.should_update_logs
    if not (logging or step in tracer.trace_steps):
        return None
    observation = tracer.observe(step)
    if observation is None:
        return None
    if logging:
        # Straight to the loggers, like LearningRateMonitor: a diagnostic, not a metric that callbacks or the
        # progress bar compare with single-device training.
        metrics = {
            "pipeline/bubble_fraction": observation.bubble_fraction,
            "pipeline/ideal_bubble_fraction": observation.ideal_bubble_fraction,
        }
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.fit_loop.epoch_loop._batches_that_stepped)
    return observation
