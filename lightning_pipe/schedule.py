"""The GPipe schedule: the ordered actions each stage performs in one training step.

With 3 stages and 4 micro-batches, forward (F) and backward (B) of micro-batch ``m`` run at these clock ticks
(stages wait on their neighbours, so stage ``s`` starts ``s`` ticks late; ``.`` is the idle bubble)::

    tick     0   1   2   3   4   5   6   7   8   9  10  11
    stage 0  F0  F1  F2  F3  .   .   .   .   B3  B2  B1  B0
    stage 1  .   F0  F1  F2  F3  .   .   B3  B2  B1  B0  .
    stage 2  .   .   F0  F1  F2  F3  B3  B2  B1  B0  .   .

Every stage runs all forwards, then all backwards in reverse order: the loss is computed on the joined output
of all micro-batches (the user's ``training_step`` sees the whole mini-batch), so no backward can start before the
last forward. Schedules that interleave forwards and backwards (1F1B) need a loss per micro-batch instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Action:
    """One unit of work on a stage: the forward or backward of one micro-batch (with its receive and send)."""

    kind: Literal["forward", "backward"]
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.kind[0].upper()}{self.micro_batch}"


def gpipe_actions(num_micro_batches: int, *, training: bool = True) -> list[Action]:
    """The actions of every stage in one GPipe step: forward 0..M-1, then (when training) backward M-1..0."""
    forwards = [Action("forward", m) for m in range(num_micro_batches)]
    if not training:
        return forwards
    return forwards + [Action("backward", m) for m in reversed(range(num_micro_batches))]


def recomputes(mode: str, micro_batch: int, num_micro_batches: int) -> bool:
    """Whether micro-batch ``micro_batch`` re-computes its forward in backward under the activation re-computation
    ``mode`` (the public ``checkpoint`` option): ``"always"``; ``"except_last"``, every micro-batch but the last,
    whose backward comes first, so its activations would be freed soonest anyway; ``"never"``."""
    if mode == "always":
        return True
    if mode == "except_last":
        return micro_batch < num_micro_batches - 1
    return False


def clock_cycles(num_stages: int, num_micro_batches: int) -> list[list[Action | None]]:
    """The ideal timeline: ``timeline[stage][tick]`` is the action running then, or ``None`` for a bubble.

    Assumes every forward and backward takes one tick, as the picture in this module's docstring does.
    """
    ticks = 2 * (num_micro_batches + num_stages - 1)
    timeline: list[list[Action | None]] = [[None] * ticks for _ in range(num_stages)]
    for stage in range(num_stages):
        for m in range(num_micro_batches):
            timeline[stage][stage + m] = Action("forward", m)
            backward_tick = num_micro_batches + 2 * (num_stages - 1) - stage + (num_micro_batches - 1 - m)
            timeline[stage][backward_tick] = Action("backward", m)
    return timeline


def ideal_bubble_fraction(num_stages: int, num_micro_batches: int) -> float:
    """Fraction of a step each stage idles in GPipe with equal stages: ``(S - 1) / (M + S - 1)``."""
    return (num_stages - 1) / (num_micro_batches + num_stages - 1)


def render_timeline(num_stages: int, num_micro_batches: int) -> str:
    """The ideal timeline as the text table shown in this module's docstring."""
    timeline = clock_cycles(num_stages, num_micro_batches)
    width = max(3, len(str(num_micro_batches - 1)) + 2)
    header = "tick     " + "".join(f"{tick:<{width}}" for tick in range(len(timeline[0])))
    rows = [
        f"stage {stage:<3}" + "".join(f"{str(action) if action else '.':<{width}}" for action in row)
        for stage, row in enumerate(timeline)
    ]
    return "\n".join(line.rstrip() for line in [header, *rows])
