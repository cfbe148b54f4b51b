"""The benchmark sizes: a compute-bound deep stack of equal blocks, and the tiny ``--quick`` variant.

Kept free of torch so that the launching process stays light; the workers build the model in :mod:`harness.stack`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


# The targets (engine efficiency, ratio to the peer, Lightning overhead, memory) are stated at 2 stages and M = 8.
TARGET_MICRO_BATCHES = 8


@dataclass(frozen=True)
class Workload:
    """What every speed and memory benchmark runs: ``depth`` blocks of ``Linear(width, width) + ReLU``."""

    width: int
    depth: int
    batch: int
    micro_batches: tuple[int, ...]  # the values of M compared
    warmup: int  # steps run before any is measured
    rounds: int  # measured steps per configuration; configurations take turns, one step each per round
    fits: int  # Lightning overhead: measured Trainer.fit calls, each alternating with a plain engine loop
    steps_per_fit: int  # training steps in each of those fits and loops (the first one is not measured)

    @property
    def reference_micro_batches(self) -> int:
        """The M at which the targets are checked: the issue's M, or the largest one measured (``--quick``)."""
        return TARGET_MICRO_BATCHES if TARGET_MICRO_BATCHES in self.micro_batches else max(self.micro_batches)

    @property
    def description(self) -> str:
        """How the section headers describe this workload and its measurement."""
        return (
            f"{self.depth} × (Linear({self.width}, {self.width}) + ReLU), batch {self.batch}, one thread per process;"
            f" median of {self.rounds} steps after {self.warmup} warm-up steps, the configurations taking turns step"
            " by step"
        )

    def to_spec(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_spec(spec: dict[str, Any]) -> Workload:
        fields = {**spec["workload"], "micro_batches": tuple(spec["workload"]["micro_batches"])}
        return Workload(**fields)


FULL = Workload(
    width=512, depth=16, batch=1024, micro_batches=(1, 2, 4, 8, 16), warmup=3, rounds=9, fits=4, steps_per_fit=8
)
QUICK = Workload(width=32, depth=4, batch=32, micro_batches=(1, 2, 4), warmup=1, rounds=2, fits=1, steps_per_fit=3)


def workload(quick: bool) -> Workload:
    return QUICK if quick else FULL
