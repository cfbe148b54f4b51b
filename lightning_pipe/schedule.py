"""Pipeline schedules: the ordered actions each stage performs in one training step, which the engine executes.

A schedule is a pure function ``(stage, num_stages, num_micro_batches, recompute) -> list[Action]``. GPipe with 3
stages and 4 micro-batches, forward (F) and backward (B) of micro-batch ``m`` at these clock ticks when each takes
one tick (stages wait on their neighbours; ``.`` is the idle bubble; :func:`render_timeline` draws it from the
actions)::

    tick     0  1  2  3  4  5  6  7  8  9  10 11
    stage 0  F0 F1 F2 F3 .  .  .  .  B3 B2 B1 B0
    stage 1  .  F0 F1 F2 F3 .  .  B3 B2 B1 B0 .
    stage 2  .  .  F0 F1 F2 F3 B3 B2 B1 B0 .  .

Every stage runs all forwards, then all backwards: the loss is computed on the joined output of all micro-batches
(the user's ``training_step`` sees the whole mini-batch), so no backward can start before the last forward. Any
schedule of that shape runs unchanged (the order of the backwards is free). Schedules that interleave forwards and
backwards (1F1B, zero-bubble) need a loss per micro-batch instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

# recv: wait for a micro-batch's activations from the previous stage; send: pass its output to the next one;
# recv_grad / send_grad: the same for gradients, in the other direction. forward and backward run this stage's
# layers; a forward with ``recompute`` keeps only its inputs and runs again inside its backward.
ActionKind = Literal["recv", "forward", "send", "recv_grad", "backward", "send_grad"]
FORWARD_PHASE: tuple[ActionKind, ...] = ("recv", "forward", "send")
BACKWARD_PHASE: tuple[ActionKind, ...] = ("recv_grad", "backward", "send_grad")


@dataclass(frozen=True)
class Action:
    """One unit of work of a stage for one micro-batch."""

    kind: ActionKind
    micro_batch: int
    recompute: bool = False  # forward only: re-compute the activations in backward instead of keeping them

    def __str__(self) -> str:
        short = {"recv": "R", "forward": "F", "send": "S", "recv_grad": "r", "backward": "B", "send_grad": "s"}
        return f"{short[self.kind]}{self.micro_batch}"


Schedule = Callable[[int, int, int, str], list[Action]]


def recomputes(mode: str, micro_batch: int, num_micro_batches: int) -> bool:
    """Whether micro-batch ``micro_batch`` re-computes its forward in backward under the activation re-computation
    ``mode`` (the public ``checkpoint`` option): ``"always"``; ``"except_last"``, every micro-batch but the last,
    whose backward comes first, so its activations would be freed soonest anyway; ``"never"``."""
    if mode == "always":
        return True
    if mode == "except_last":
        return micro_batch < num_micro_batches - 1
    return False


def gpipe(stage: int, num_stages: int, num_micro_batches: int, recompute: str) -> list[Action]:
    """GPipe: receive, forward and send micro-batches 0..M-1, then receive the gradient, backward and send the input
    gradient of M-1..0 (the order in which autograd reaches them from a loss on the joined output)."""
    first, last = stage == 0, stage == num_stages - 1
    actions: list[Action] = []
    for m in range(num_micro_batches):
        actions += [Action("recv", m)] if not first else []
        actions.append(Action("forward", m, recomputes(recompute, m, num_micro_batches)))
        actions += [Action("send", m)] if not last else []
    for m in reversed(range(num_micro_batches)):
        actions += [Action("recv_grad", m)] if not last else []
        actions.append(Action("backward", m))
        actions += [Action("send_grad", m)] if not first else []
    return actions


SCHEDULES: dict[str, Schedule] = {"gpipe": gpipe}


def phases(actions: list[Action], num_micro_batches: int) -> tuple[list[Action], list[Action]]:
    """The forward phase (run inside the pipelined call) and the backward phase (run by ``backward``) of a stage's
    actions; a ``ValueError`` if the schedule interleaves them or misses a micro-batch."""
    split = next((i for i, action in enumerate(actions) if action.kind in BACKWARD_PHASE), len(actions))
    forwards, backwards = actions[:split], actions[split:]
    if any(action.kind in FORWARD_PHASE for action in backwards):
        raise ValueError(
            "the schedule runs a forward after a backward; the loss is computed on the whole mini-batch, so every"
            " forward must come before the first backward."
        )
    for phase, kind in ((forwards, "forward"), (backwards, "backward")):
        done = sorted(action.micro_batch for action in phase if action.kind == kind)
        if backwards and done != list(range(num_micro_batches)):
            raise ValueError(f"the schedule's {kind}s cover micro-batches {done}, not each of 0..{num_micro_batches - 1} once.")
    return forwards, backwards


def clock_cycles(
    num_stages: int, num_micro_batches: int, schedule: Schedule = gpipe, recompute: str = "never"
) -> list[list[Action | None]]:
    """The ideal timeline of ``schedule``: ``timeline[stage][tick]`` is the forward or backward running then, or
    ``None`` for a bubble. Every forward and backward takes one tick and messages none: a stage runs its next
    action as soon as the neighbour it waits on (the previous stage for a forward, the next for a backward) has
    finished that micro-batch."""
    queues = [
        [a for a in schedule(s, num_stages, num_micro_batches, recompute) if a.kind in ("forward", "backward")]
        for s in range(num_stages)
    ]
    finished: dict[tuple[int, str, int], int] = {}  # (stage, kind, micro-batch) -> tick it ran at
    timeline: list[list[Action | None]] = [[] for _ in range(num_stages)]
    tick = 0
    while any(queues):
        for stage, queue in enumerate(queues):
            action = queue[0] if queue else None
            if action is not None:
                source = stage - 1 if action.kind == "forward" else stage + 1
                if 0 <= source < num_stages and finished.get((source, action.kind, action.micro_batch), tick) >= tick:
                    action = None  # its input is not there yet
            if action is not None:
                queue.pop(0)
                finished[(stage, action.kind, action.micro_batch)] = tick
            timeline[stage].append(action)
        tick += 1
    return timeline


def ideal_bubble_fraction(num_stages: int, num_micro_batches: int) -> float:
    """Fraction of a step each stage idles in GPipe with equal stages: ``(S - 1) / (M + S - 1)``."""
    return (num_stages - 1) / (num_micro_batches + num_stages - 1)


def render_timeline(num_stages: int, num_micro_batches: int, schedule: Schedule = gpipe) -> str:
    """The ideal timeline as the text table shown in this module's docstring."""
    timeline = clock_cycles(num_stages, num_micro_batches, schedule)
    width = max(3, len(str(num_micro_batches - 1)) + 2)
    header = "tick     " + "".join(f"{tick:<{width}}" for tick in range(len(timeline[0])))
    rows = [
        f"stage {stage:<3}" + "".join(f"{str(action) if action else '.':<{width}}" for action in row)
        for stage, row in enumerate(timeline)
    ]
    return "\n".join(line.rstrip() for line in [header, *rows])
