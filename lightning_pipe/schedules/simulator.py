"""The schedule simulator: checks each stage's list of actions against the rules a pipeline obeys, executes them at
ideal costs, and draws the timeline.

:func:`clock_cycles` finds when each action runs (and refuses a list that would deadlock, run a micro-batch twice or
a message out of order, naming the stage and the action); :func:`render_timeline` draws the result as text.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Union, get_args

from lightning_pipe.schedules.actions import (
    COMPUTE_KINDS, INPUT_GRADIENT_KINDS, Action, ActionKind, PipelineSchedule, Placement, owner, stage_chunks,
)
from lightning_pipe.schedules.builtin import SCHEDULES

def check_schedule(
    schedule: PipelineSchedule, num_stages: int, num_micro_batches: int, virtual_stages: int | None = None
) -> None:
    """Raise a ``ValueError`` naming the stage, the action and the broken rule unless ``schedule`` runs correctly
    with every micro-batch count from 1 to ``num_micro_batches`` (a smaller last batch splits into fewer)."""
    for count in range(1, num_micro_batches + 1):
        clock_cycles(num_stages, count, schedule, virtual_stages)


# ---- the simulator ----------------------------------------------------------------------------------------------

# Ticks of each compute action in the ideal timeline: a chunk's forward, input gradient and weight gradient cost
# the same (the Zero Bubble paper's assumption); a full backward is both gradients. Messages are free and instant.
DEFAULT_COSTS: dict[str, int] = {"forward": 1, "backward_input": 1, "backward_weight": 1, "backward": 2}
_ACTIVATION, _GRADIENT = "activation", "gradient"
# What each compute action costs: one cost per kind for every chunk, or one such mapping per chunk (in model order),
# for chunks of unequal cost (a heavy head on the last chunks, say). Ticks, or seconds for a predicted step.
Costs = Union[Mapping[str, float], Sequence[Mapping[str, float]]]


class ScheduledAction(NamedTuple):
    """A compute action at its place in the ideal timeline: it runs from tick ``start`` up to ``end``."""

    start: float
    end: float
    action: Action


@dataclass(frozen=True)
class Simulation:
    """A schedule executed with ideal costs (:func:`clock_cycles`).

    ``intervals[stage]`` holds the stage's compute actions at their ticks; ``peak_in_flight[stage]`` the most
    (chunk, micro-batch) pairs whose forward had run and whose backward (or weight gradient) had not, at any
    point: the activations the stage holds at once, in units of one chunk's activations of one micro-batch.
    """

    intervals: tuple[tuple[ScheduledAction, ...], ...]
    peak_in_flight: tuple[int, ...]

    @property
    def makespan(self) -> float:
        """Ticks from the first action's start to the last one's end."""
        return max((stage[-1].end for stage in self.intervals if stage), default=0)

    @property
    def bubble_fraction(self) -> float:
        """The idle share of the makespan, over all stages."""
        busy = sum(a.end - a.start for stage in self.intervals for a in stage)
        total = self.makespan * len(self.intervals)
        return (total - busy) / total if total else 0.0


def clock_cycles(
    num_stages: int,
    num_micro_batches: int,
    schedule: str | PipelineSchedule = "gpipe",
    virtual_stages: int | None = None,
    costs: Costs = DEFAULT_COSTS,
    send_time: float = 0,
    action_time: float = 0,
) -> Simulation:
    """Check ``schedule``'s lists and execute them with ``costs`` ticks per compute action (:data:`DEFAULT_COSTS`;
    or one mapping per chunk, :data:`Costs`), a message arriving ``send_time`` after it is sent, and the runtime
    spending ``action_time`` before each compute action (its own cost: dispatching the action, posting its messages).

    Each stage runs its list strictly in order; a send never blocks, a receive waits until the matching send has run
    and ``send_time`` has passed. A ``ValueError`` names the stage, the action and the rule for: a (chunk, micro-batch)
    run twice or never, an action before what it needs (its input, its output's gradient, its forward), a message
    whose sender and receiver disagree on the order, and a deadlock (no stage can proceed while actions remain).
    """
    schedule = SCHEDULES[schedule] if isinstance(schedule, str) else schedule
    v = schedule.checked_virtual_stages(virtual_stages)
    where = (
        f"schedule {schedule.name!r} with {_count(num_stages, 'stage')}, {_count(num_micro_batches, 'micro-batch')}"
        f" and {_count(v, 'chunk')} per stage"
    )
    lists = [schedule.actions(stage, num_stages, num_micro_batches, v) for stage in range(num_stages)]
    grid = _Grid(num_stages, num_micro_batches, v, schedule.placement, schedule.per_micro_batch, where)
    for stage, actions in enumerate(lists):
        grid.check_stage(stage, actions)
    grid.check_message_order(lists)
    intervals = _run(lists, grid, _per_chunk(costs, grid), send_time, action_time)
    return Simulation(intervals, tuple(int(peak_held(actions)) for actions in lists))


def _per_chunk(costs: Costs, grid: _Grid) -> list[Mapping[str, float]]:
    """One mapping of costs per chunk; a ``ValueError`` naming what is missing."""
    chunks = grid.last_chunk + 1
    per_chunk = [costs] * chunks if isinstance(costs, Mapping) else list(costs)
    if len(per_chunk) != chunks:
        raise ValueError(
            f"{grid.where}: costs name {len(per_chunk)} chunks but the step has {chunks}; give one mapping per chunk"
            " (stages x chunks per stage, in model order) or one mapping for all"
        )
    for chunk, kinds in enumerate(per_chunk):
        missing = [kind for kind in ("forward", "backward_input", "backward_weight", "backward") if kind not in kinds]
        if missing:
            raise ValueError(f"{grid.where}: the costs of chunk {chunk} lack {missing}; give a cost for every kind")
    return per_chunk


def ideal_bubble(schedule: PipelineSchedule, num_stages: int, num_micro_batches: int, virtual_stages: int) -> float:
    """The idle share of a step with equal chunks, forward, input gradient and weight gradient one tick each: the
    schedule's formula, or the simulated share where it has none."""
    if schedule.bubble_formula is not None:
        return schedule.bubble_formula(num_stages, num_micro_batches, virtual_stages)
    return clock_cycles(num_stages, num_micro_batches, schedule, virtual_stages).bubble_fraction


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" if number == 1 else f"{number} {noun}es" if noun.endswith("h") else f"{number} {noun}s"


@dataclass(frozen=True)
class _Grid:
    """The shape of one step (stages, micro-batches, chunks and where they live) and the rules a stage's list obeys."""

    num_stages: int
    num_micro_batches: int
    virtual_stages: int
    placement: Placement
    per_micro_batch: bool
    where: str

    @property
    def last_chunk(self) -> int:
        return self.num_stages * self.virtual_stages - 1

    def owner(self, chunk: int) -> int:
        return owner(chunk, self.num_stages, self.placement)

    def fail(self, stage: int, index: int | None, action: Action, rule: str) -> ValueError:
        at = f"action {index}, {action}," if index is not None else f"{action}"
        return ValueError(f"{self.where}: stage {stage}'s {at} {rule}")

    def check_stage(self, stage: int, actions: list[Action]) -> None:
        """Each action where its inputs are ready, each (chunk, micro-batch) forwarded and back-propagated once."""
        done: dict[str, set[tuple[int, int]]] = {kind: set() for kind in get_args(ActionKind)}
        local = stage_chunks(stage, self.num_stages, self.virtual_stages, self.placement)
        for index, action in enumerate(actions):
            rule = self._broken_rule(stage, action, done, local)
            if rule is not None:
                raise self.fail(stage, index, action, rule)
            done[action.kind].add((action.chunk, action.micro_batch))
        for k in local:
            for m in range(self.num_micro_batches):
                needed = [Action("forward", m, k)]
                if (k, m) in done["backward_input"]:
                    needed.append(Action("backward_weight", m, k))
                elif (k, m) not in done["backward"]:
                    needed.append(Action("backward", m, k))
                for action in needed:
                    if (k, m) not in done[action.kind]:
                        rule = "never runs: every (chunk, micro-batch) needs one forward and one backward (full, or"
                        raise self.fail(stage, None, action, rule + " input then weight gradients) on its stage")

    def _broken_rule(
        self, stage: int, action: Action, done: dict[str, set[tuple[int, int]]], local: list[int]
    ) -> str | None:
        """Why ``action`` cannot run after the actions ``done`` on ``stage`` (which holds the chunks ``local``), or
        ``None``."""
        k, m, kind = action.chunk, action.micro_batch, action.kind
        if not 0 <= k <= self.last_chunk:
            return f"names a chunk outside 0..{self.last_chunk}"
        if k not in local:
            return f"runs a chunk that the {self.placement!r} placement puts on stage {self.owner(k)}"
        if not 0 <= m < self.num_micro_batches:
            return f"names a micro-batch outside 0..{self.num_micro_batches - 1}"
        if action.recompute and kind != "forward":
            return "re-computes, which only a forward can"
        backed = done["backward"] | done["backward_input"]
        if (k, m) in (backed if kind in INPUT_GRADIENT_KINDS else done[kind]):
            return "runs twice: each action happens once per (chunk, micro-batch)"
        if kind in ("recv", "send_grad") and not self._crosses_stages(stage, k - 1):
            return "crosses no stage boundary: the chunk's input is the data or computed on this stage"
        if kind in ("send", "recv_grad") and not self._crosses_stages(stage, k + 1):
            return "crosses no stage boundary: the chunk's output feeds the loss or a chunk on this stage"
        for kinds, (chunk, micro_batch), what in self._prerequisites(stage, action):
            if not any((chunk, micro_batch) in done[before] for before in kinds):
                return f"runs before {what}"
        if kind in INPUT_GRADIENT_KINDS and k == self.last_chunk and not self.per_micro_batch:
            missing = [mb for mb in range(self.num_micro_batches) if (k, mb) not in done["forward"]]
            if missing:
                return (
                    f"runs before the forward of micro-batch {missing[0]}: the loss is computed on the whole"
                    " mini-batch, so every forward of the last chunk comes first (a schedule that interleaves"
                    " needs per_micro_batch=True)"
                )
        return None

    def _crosses_stages(self, stage: int, chunk: int) -> bool:
        """Whether a message between ``stage`` and ``chunk`` crosses to another stage (``chunk`` exists)."""
        return 0 <= chunk <= self.last_chunk and self.owner(chunk) != stage

    def _prerequisites(
        self, stage: int, action: Action
    ) -> list[tuple[tuple[ActionKind, ...], tuple[int, int], str]]:
        """What must come before ``action`` on its stage: (any of these kinds, of this (chunk, micro-batch), why)."""
        k, m, kind = action.chunk, action.micro_batch, action.kind
        if kind == "forward" and k > 0:
            if self._crosses_stages(stage, k - 1):
                return [(("recv",), (k, m), "its receive, which provides its input")]
            return [(("forward",), (k - 1, m), f"forward(chunk {k - 1}, micro-batch {m}), which provides its input")]
        if kind == "send":
            return [(("forward",), (k, m), "its forward")]
        if kind in INPUT_GRADIENT_KINDS:
            needed = [(("forward",), (k, m), "its forward")]
            if self._crosses_stages(stage, k + 1):
                needed.append((("recv_grad",), (k, m), "its recv_grad, which provides its output's gradient"))
            elif k < self.last_chunk:
                why = f"the backward of chunk {k + 1}, micro-batch {m}, which provides its output's gradient"
                needed.append((INPUT_GRADIENT_KINDS, (k + 1, m), why))
            return needed
        if kind == "backward_weight":
            return [(("backward_input",), (k, m), "its backward_input (a full backward computes both gradients)")]
        if kind == "send_grad":
            return [(INPUT_GRADIENT_KINDS, (k, m), "its backward")]
        return []

    def message(self, stage: int, action: Action) -> tuple[tuple[int, int, str], tuple[int, int]] | None:
        """The channel ``(sender, receiver, kind)`` and the message ``(boundary chunk, micro-batch)`` that ``action``
        sends or receives; the boundary is the chunk an activation enters, or whose input a gradient is."""
        k, m, kind = action.chunk, action.micro_batch, action.kind
        if kind == "send":
            return (stage, self.owner(k + 1), _ACTIVATION), (k + 1, m)
        if kind == "recv":
            return (self.owner(k - 1), stage, _ACTIVATION), (k, m)
        if kind == "send_grad":
            return (stage, self.owner(k - 1), _GRADIENT), (k, m)
        if kind == "recv_grad":
            return (self.owner(k + 1), stage, _GRADIENT), (k + 1, m)
        return None

    def check_message_order(self, lists: list[list[Action]]) -> None:
        """For each pair of stages and each kind of message, the receiver receives in the order the sender sends:
        point-to-point messages match in order, without tags."""
        sent: dict[tuple[int, int, str], list[tuple[tuple[int, int], int, Action]]] = {}
        received: dict[tuple[int, int, str], list[tuple[tuple[int, int], int, Action]]] = {}
        for stage, actions in enumerate(lists):
            for index, action in enumerate(actions):
                found = self.message(stage, action)
                if found is not None:
                    channel, message = found
                    side = sent if action.kind.startswith("send") else received
                    side.setdefault(channel, []).append((message, index, action))
        for channel in sorted(set(sent) | set(received)):
            sender, receiver, kind = channel
            sends, receives = sent.get(channel, []), received.get(channel, [])
            for n in range(max(len(sends), len(receives))):
                if n >= len(receives):
                    _, index, action = sends[n]
                    raise self.fail(sender, index, action, f"is an {kind} that stage {receiver} never receives")
                if n >= len(sends):
                    _, index, action = receives[n]
                    raise self.fail(receiver, index, action, f"waits for an {kind} that stage {sender} never sends")
                if sends[n][0] != receives[n][0]:
                    _, index, action = receives[n]
                    raise self.fail(
                        receiver, index, action,
                        f"is its receive number {n} from stage {sender}, but stage {sender}'s send number {n} there is"
                        f" {sends[n][2]} (action {sends[n][1]}): a stage must receive its {kind}s in the order they"
                        " are sent",
                    )


def _run(
    lists: list[list[Action]], grid: _Grid, costs: list[Mapping[str, float]], send_time: float, action_time: float
) -> tuple[tuple[ScheduledAction, ...], ...]:
    """Each stage's compute actions at the ticks they run, each stage going as far as its receives allow; a
    ``ValueError`` if every unfinished stage waits for a message that will never be sent."""
    position, clock = [0] * len(lists), [0] * len(lists)  # ints stay ints (ticks); seconds make floats
    sent_at: dict[tuple[int, int, str], list[float]] = {}
    taken: dict[tuple[int, int, str], int] = {}
    intervals: list[list[ScheduledAction]] = [[] for _ in lists]
    recomputed: set[tuple[int, int]] = set()  # a re-computed forward runs again inside its (input-gradient) backward
    progress = True
    while progress:
        progress = False
        for stage, actions in enumerate(lists):
            while position[stage] < len(actions):
                action = actions[position[stage]]
                found = grid.message(stage, action)
                if action.kind in COMPUTE_KINDS:
                    start, pair = clock[stage] + action_time, (action.chunk, action.micro_batch)
                    clock[stage] = start + costs[action.chunk][action.kind]
                    if action.kind == "forward" and action.recompute:
                        recomputed.add(pair)
                    elif action.kind in INPUT_GRADIENT_KINDS and pair in recomputed:
                        clock[stage] += costs[action.chunk]["forward"]
                    intervals[stage].append(ScheduledAction(start, clock[stage], action))
                elif action.kind in ("send", "send_grad"):
                    assert found is not None
                    sent_at.setdefault(found[0], []).append(clock[stage])
                else:
                    assert found is not None
                    channel = found[0]
                    n = taken.get(channel, 0)
                    if n >= len(sent_at.get(channel, [])):
                        break  # blocked: the message has not been sent yet
                    clock[stage] = max(clock[stage], sent_at[channel][n] + send_time)
                    taken[channel] = n + 1
                position[stage] += 1
                progress = True
    blocked = [stage for stage, actions in enumerate(lists) if position[stage] < len(actions)]
    if blocked:
        waits = "; ".join(
            f"stage {s} waits at action {position[s]}, {lists[s][position[s]]}, for stage"
            f" {grid.message(s, lists[s][position[s]])[0][0]}"  # type: ignore[index]
            for s in blocked
        )
        raise ValueError(f"{grid.where}: deadlock, no stage can proceed while actions remain: {waits}.")
    return tuple(tuple(stage) for stage in intervals)


def peak_held(
    actions: list[Action],
    size: Callable[[int], float] = lambda chunk: 1,
    recomputed_size: Callable[[int], float] | None = None,
) -> float:
    """The most a stage holds at once of what each forward keeps until its (weight) backward: by default the count of
    (chunk, micro-batch) pairs in flight; ``size(chunk)`` of each (its activation bytes, say) when given.

    A re-computed forward (``recompute``) keeps only ``recomputed_size(chunk)`` (its input) when that is given; its
    activations come back in its backward (from the input gradient to the weight gradient when split)."""
    held = peak = 0.0
    kept: dict[tuple[int, int], float] = {}
    for action in actions:
        pair = (action.chunk, action.micro_batch)
        if action.kind == "forward":
            recomputed = action.recompute and recomputed_size is not None
            kept[pair] = recomputed_size(action.chunk) if recomputed else size(action.chunk)  # type: ignore[misc]
            held += kept[pair]
        elif action.kind in INPUT_GRADIENT_KINDS and pair in kept:
            held += size(action.chunk) - kept[pair]  # a re-computed forward's activations, back for its backward
            kept[pair] = size(action.chunk)
            if action.kind == "backward":
                peak = max(peak, held)
                held -= kept.pop(pair)
        elif action.kind == "backward_weight" and pair in kept:
            held -= kept.pop(pair)
        peak = max(peak, held)
    return peak


# ---- the picture ------------------------------------------------------------------------------------------------


def render_timeline(
    num_stages: int,
    num_micro_batches: int,
    schedule: str | PipelineSchedule = "gpipe",
    virtual_stages: int | None = None,
) -> str:
    """The ideal timeline (:func:`clock_cycles`) as a text table, one column per tick.

    ``F3`` is the forward of micro-batch 3, ``B3`` its full backward, ``I3`` its input gradient and ``W3`` its
    weight gradient; an action of several ticks continues with ``--``; ``.`` is idle. With several chunks per
    stage a letter names the stage's chunk, in model order: ``F3a`` runs the stage's first chunk, ``F3b`` its
    second (in a V, ``a`` is on the way down and ``b`` on the way back up).
    """
    schedule = SCHEDULES[schedule] if isinstance(schedule, str) else schedule
    v = schedule.checked_virtual_stages(virtual_stages)
    simulation = clock_cycles(num_stages, num_micro_batches, schedule, v)
    letters = {k: chr(ord("a") + i) for s in range(num_stages) for i, k in enumerate(schedule.chunks(s, num_stages, v))}
    short = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W"}

    def label(action: Action) -> str:
        return f"{short[action.kind]}{action.micro_batch}{letters[action.chunk] if v > 1 else ''}"

    width = max(3, len(f"F{num_micro_batches - 1}") + (2 if v > 1 else 1))
    cells = []
    for stage in simulation.intervals:
        row = ["."] * simulation.makespan
        for start, end, action in stage:
            row[start:end] = [label(action)] + ["-" * (width - 1)] * (end - start - 1)
        cells.append(row)
    header = "tick     " + "".join(f"{tick:<{width}}" for tick in range(simulation.makespan))
    rows = [f"stage {s:<3}" + "".join(f"{cell:<{width}}" for cell in row) for s, row in enumerate(cells)]
    return "\n".join(line.rstrip() for line in [header, *rows])


