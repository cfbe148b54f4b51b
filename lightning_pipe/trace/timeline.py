"""What one stage did during one training step, interval by interval, and the bubble that leaves.

The engine stamps the start and end of every forward, backward, re-computation, send and receive (``wait``: from
asking for a micro-batch or a gradient until it is there). Stamps are host clock readings on the CPU; on CUDA they
are events on the compute stream, turned into host times when the step's intervals are read, so that recording
never blocks the host in the middle of a step. Recording costs a few clock readings per micro-batch; a disabled
timeline returns at once.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch

FORWARD = "forward"
BACKWARD = "backward"
RECOMPUTE = "recompute"  # nested inside a backward: the forward run again to re-compute its activations
SEND = "send"  # posting a send; the transfer itself completes asynchronously
WAIT = "wait"  # from asking for a micro-batch's activations (or gradients) until they are there
KINDS = (FORWARD, BACKWARD, RECOMPUTE, SEND, WAIT)
COMPUTE_KINDS = (FORWARD, BACKWARD)  # a stage is busy during these; RECOMPUTE lies inside BACKWARD

Stamp = Union[float, "torch.cuda.Event"]


@dataclass(frozen=True)
class Interval:
    """One thing a stage did: its kind, the micro-batch it was for, and when (seconds on the aligned clock)."""

    kind: str
    micro_batch: int
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


class StepTimeline:
    """The intervals of this stage in the current step. One per process, owned by the strategy, fed by the engine.

    ``offset`` is subtracted from every time read, so that the timelines of all ranks share one clock (see
    :func:`lightning_pipe.trace.tracer.align_clocks`).
    """

    def __init__(self, device: torch.device, enabled: bool = True) -> None:
        self.enabled = enabled
        self.offset = 0.0
        self._cuda = device.type == "cuda"
        self._device = device
        self._records: list[tuple[str, int, Stamp, Stamp]] = []
        self._reference: tuple[Any, float] | None = None  # (CUDA event, host time when it completed)

    def begin_step(self) -> None:
        """Forget the previous step's intervals."""
        self._records = []
        if self.enabled and self._cuda:
            reference = torch.cuda.Event(enable_timing=True)
            reference.record()
            reference.synchronize()
            self._reference = (reference, time.perf_counter())

    def now(self) -> Stamp:
        """A stamp of the current point of this stage's work (0.0 when disabled)."""
        if not self.enabled:
            return 0.0
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def add(self, kind: str, micro_batch: int, start: Stamp) -> None:
        """Record an interval of ``kind`` for ``micro_batch`` from ``start`` until now."""
        if self.enabled:
            self._records.append((kind, micro_batch, start, self.now()))

    @contextlib.contextmanager
    def recomputing(self, micro_batch: int) -> Iterator[None]:
        """Records the re-computation of ``micro_batch`` (entered by ``torch.utils.checkpoint`` in backward)."""
        start = self.now()
        try:
            yield
        finally:  # torch's checkpoint stops the re-computation early by raising once every saved tensor exists again
            self.add(RECOMPUTE, micro_batch, start)

    def intervals(self) -> list[Interval]:
        """The current step's intervals on the aligned clock, in the order they were recorded."""
        if self._cuda and self._records:
            torch.cuda.synchronize(self._device)
        return [
            Interval(kind, m, self._seconds(start), self._seconds(end)) for kind, m, start, end in self._records
        ]

    def _seconds(self, stamp: Stamp) -> float:
        if isinstance(stamp, float):
            return stamp - self.offset
        assert self._reference is not None
        event, host = self._reference
        return host + event.elapsed_time(stamp) / 1e3 - self.offset


@dataclass(frozen=True)
class StageExtent:
    """When a stage's pipelined compute began and ended in a step, and how long it computed in between."""

    first_start: float
    last_end: float
    busy: float

    def as_list(self) -> list[float]:
        return [self.first_start, self.last_end, self.busy]


def stage_extent(intervals: Sequence[Interval]) -> StageExtent | None:
    """The extent of one stage's compute (forwards and backwards), or ``None`` if it computed nothing."""
    compute = [i for i in intervals if i.kind in COMPUTE_KINDS]
    if not compute:
        return None
    return StageExtent(min(i.start for i in compute), max(i.end for i in compute), sum(i.duration for i in compute))


def bubble_fraction(extents: Sequence[StageExtent]) -> float:
    """The fraction of the pipeline's compute window that stages spend idle, averaged over stages.

    The window runs from the first forward on any stage to the last backward on any stage. With equal stages and
    free communication, GPipe's stages each idle ``(S - 1) / (M + S - 1)`` of it
    (:func:`lightning_pipe.schedules.simulator.ideal_bubble`); unequal stages and communication add to that.
    """
    window = max(e.last_end for e in extents) - min(e.first_start for e in extents)
    if window <= 0:
        return 0.0
    return sum(1.0 - e.busy / window for e in extents) / len(extents)
