"""The stall watchdog's rule: when a wait on another rank has lasted too long, and who stopped.

Pure logic, no processes (the watchdog that applies it is :mod:`lightning_pipe.reliability.watchdog`):

* :class:`StallRule`: the bound on a wait, ``max(floor, multiple * the slowest recent training step)``.
* :class:`StepClock`: the bookkeeping of training steps. A *regular* step gets the bound learned from the run. A
  *first* step gets the first step's bound (see :class:`StallRule`): one of the first steps of a run
  (``torch.compile``'s first calls, allocations, a resumed run's first steps), the first of an epoch or the first
  after an uneven phase (validation, a checkpoint, the epoch's end hooks), or one whose batch has a shape no earlier
  step had (a smaller last batch, the BatchNorm check and a recompilation that come with it). A sharded checkpoint's
  save gets the save's bound (see :class:`StallRule`); the other uneven phases get only the hard ``timeout``. Only
  regular steps' durations (start to next start) set the bound.
* :class:`StartUp`: what the set-up measured, from which the first step's bound is derived.
* :class:`Wait`, :class:`RankState`, :func:`stalled_ranks`: what each rank waits for and on whom, and from all ranks'
  answers, which rank stopped: one that others wait on and that waits on no one.
* :func:`stall_message`: the error each rank raises, naming its own wait and the rank that stopped.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

WARMUP_STEPS = 2  # the first steps of a run get the first-step bound and are not timed (compilation, allocation)
WINDOW = 100  # the regular steps whose slowest sets the bound
FIRST_STEP_FLOORS = 2  # a first step's derived bound is at least this many times the floor (60 s by default)
COMPILING_FIRST_STEP_S = 600.0  # a first step's bound where a compilation runs in it: not measured before it runs


class PipelineStallError(Exception):
    """A wait on another rank outlasted the stall watchdog's bound; the run ends on every rank.

    An ``Exception`` but not a ``RuntimeError``: the code that turns a failed wait (a ``RuntimeError`` of the backend)
    into a lost-peer error lets it through, and every rank raises its own, with the wait it saw.
    """


@dataclass(frozen=True)
class StartUp:
    """What the set-up measured before the first step: how long it took (``seconds``: finding the blocks, taking the
    first training batch and running the training step on it on the meta device, profiling where asked, making the
    stage's weights real or reading them), and whether a compilation will run in the first steps (``compiles``),
    which nothing measures before it runs."""

    seconds: float = 0.0
    compiles: bool = False


@dataclass(frozen=True)
class StallRule:
    """A wait on another rank during a regular training step may last ``max(floor_s, multiple * slowest)`` seconds,
    ``slowest`` being the slowest of the last ``WINDOW`` regular steps; during a first step (see :class:`StepClock`)
    the first step's bound, or the regular bound where that is longer.

    The first step's bound is ``first_step_s`` where the user gave one. Otherwise it is derived from what the set-up
    measured (:class:`StartUp`): ``max(FIRST_STEP_FLOORS * floor_s, multiple * the set-up's seconds)`` (a minute by
    default, so that a deadlock in a first step ends in about a minute), or ``COMPILING_FIRST_STEP_S`` when a
    compilation runs in it. What makes a first step slow legitimately, the set-up did once already: it took the first
    batch from the loader (a slow loader's first batch), ran the step's code (on the meta device) and made the
    weights real (a big model)."""

    multiple: float = 10.0
    floor_s: float = 30.0
    first_step_s: float | None = None

    def bound_s(self, slowest_step_s: float) -> float:
        return max(self.floor_s, self.multiple * slowest_step_s)

    def save_bound_s(self, slowest_save_s: float | None, startup: StartUp = StartUp()) -> float:
        """The bound on a wait during a sharded checkpoint's save: ``max(floor_s, multiple * the slowest earlier save
        of the run)``; before any save was timed, a first save's ``max(FIRST_STEP_FLOORS * floor_s, multiple * the
        set-up's seconds)`` (a minute by default).

        A save ends in collectives (every part written, then the ``.metadata``, then the commit), so every rank's
        save lasts as long as the slowest rank's write: an earlier save, timed on any rank, measures the uneven write
        the waits must allow. Before the first save, the set-up made the same weights real or read them, work of the
        size of writing them, and the first save gets the first step's floor (it writes the optimizer's state too)."""
        if slowest_save_s is None:
            return max(FIRST_STEP_FLOORS * self.floor_s, self.multiple * startup.seconds)
        return max(self.floor_s, self.multiple * slowest_save_s)

    def explain_save(self, slowest_save_s: float | None, startup: StartUp = StartUp()) -> str:
        """How a save's bound came about: ``"a checkpoint save's bound: 10 x the slowest earlier save (1.20 s), at
        least stall_floor = 30 s"``."""
        if slowest_save_s is None:
            return (f"a first checkpoint save's bound: {self.multiple:g} x the set-up's {startup.seconds:.2f} s, at"
                    f" least {FIRST_STEP_FLOORS} x stall_floor = {FIRST_STEP_FLOORS * self.floor_s:g} s")
        return (f"a checkpoint save's bound: {self.multiple:g} x the slowest earlier save ({slowest_save_s:.2f} s), at"
                f" least stall_floor = {self.floor_s:g} s")

    def first_step_own_s(self, startup: StartUp) -> float:
        """The first step's own bound, before the regular bound is considered (see the class)."""
        if self.first_step_s is not None:
            return self.first_step_s
        if startup.compiles:
            return COMPILING_FIRST_STEP_S
        return max(FIRST_STEP_FLOORS * self.floor_s, self.multiple * startup.seconds)

    def first_step_bound_s(self, slowest_step_s: float, startup: StartUp = StartUp()) -> float:
        return max(self.first_step_own_s(startup), self.bound_s(slowest_step_s))

    def explain(self, slowest_step_s: float, first_step: bool = False, startup: StartUp = StartUp()) -> str:
        """How the bound came about, for the error: ``"10 x the slowest recent step (0.41 s), at least 30 s"``, or for
        a first step ``"a first step's bound: 10 x the set-up's 2.10 s, at least 2 x stall_floor = 60 s"``."""
        own = self.first_step_own_s(startup)
        if first_step and self.first_step_bound_s(slowest_step_s, startup) == own:
            if self.first_step_s is not None:
                return f"a first step's bound, stall_first_step={self.first_step_s:g} s"
            if startup.compiles:
                return f"a first step's bound, {own:g} s while torch.compile compiles (its time is not measured before)"
            return (
                f"a first step's bound: {self.multiple:g} x the set-up's {startup.seconds:.2f} s, at least"
                f" {FIRST_STEP_FLOORS} x stall_floor = {FIRST_STEP_FLOORS * self.floor_s:g} s"
            )
        return f"{self.multiple:g} x the slowest recent step ({slowest_step_s:.2f} s), at least {self.floor_s:g} s"


class StepClock:
    """Which training steps are regular, how long they took, and the bound on waits now (``None``: not bounded).

    ``step_starts`` is called at the start of every training step, ``uneven_phase`` when something legitimately slow
    and uneven begins between steps, ``save_starts`` and ``save_ends`` around a sharded checkpoint's save. Every
    training step is bounded: a regular one by the bound learned from the run, any other (``first_step``) by the rule's
    first-step bound. A step's bound stays in force after it, until the next step starts or an uneven phase begins:
    the time between steps (callbacks, logging, loading the next batch) is watched too. A save is bounded by the
    save's bound (see :meth:`StallRule.save_bound_s`) from its start until the next step; the saves are timed.
    """

    def __init__(self, rule: StallRule) -> None:
        self.rule = rule
        self.startup = StartUp()  # what the set-up measured: see `StallRule.first_step_own_s`
        self.durations: deque[float] = deque(maxlen=WINDOW)
        self.steps = 0  # training steps started in this run
        self.epoch: int | None = None
        self.batch: int | None = None
        self._batch_shapes: set[Hashable] = set()
        self._started: float | None = None  # when the current step started
        self._regular = False  # whether the current step is regular
        self._interrupted = False  # an uneven phase began since the current step started
        self._ended = False  # the current step's optimizer step is done: the time between steps runs
        self.bound_s: float | None = None
        self.first_step = False  # the bound in force is a first step's
        self.saving = False  # the bound in force is a save's
        self.save_durations: deque[float] = deque(maxlen=WINDOW)
        self._save_started: float | None = None  # when the save in progress started

    def step_starts(self, now: float, epoch: int, batch: int, batch_shape: Hashable) -> None:
        continues = self._started is not None and not self._interrupted and epoch == self.epoch
        if continues and self._regular:
            self.durations.append(now - self._started)  # type: ignore[operator]
        self._regular = continues and self.steps >= WARMUP_STEPS and batch_shape in self._batch_shapes
        self._batch_shapes.add(batch_shape)
        self.steps += 1
        self.epoch, self.batch, self._started, self._interrupted, self._ended = epoch, batch, now, False, False
        self.saving, self._save_started = False, None
        self.first_step = not (self._regular and self.durations)
        slowest = self.slowest_s
        self.bound_s = self.first_step_bound_s if self.first_step else self.rule.bound_s(slowest)

    def step_ends(self) -> None:
        self._ended = True

    def uneven_phase(self) -> None:
        """Validation, a checkpoint, an epoch's end: unbounded, and the next step is a first step."""
        self._interrupted = True
        self.bound_s = None
        self.first_step = self.saving = False
        self._save_started = None

    def save_starts(self, now: float) -> None:
        """A sharded checkpoint's save begins (or goes on: its state is gathered in several calls): bounded by the
        save's bound, timed until :meth:`save_ends`, and the next step is a first step."""
        self._interrupted = True
        self.first_step, self.saving = False, True
        if self._save_started is None:
            self._save_started = now
        self.bound_s = self.rule.save_bound_s(self.slowest_save_s, self.startup)

    def save_ends(self, now: float) -> None:
        """The save is written and committed on this rank: its duration bounds the next saves. The save's bound stays
        in force until the next step (the barrier that follows the save is watched by it too)."""
        if self._save_started is not None:
            self.save_durations.append(now - self._save_started)
        self._save_started = None

    @property
    def slowest_save_s(self) -> float | None:
        return max(self.save_durations, default=None)

    @property
    def first_step_bound_s(self) -> float:
        """The bound a first step would get now."""
        return self.rule.first_step_bound_s(self.slowest_s, self.startup)

    def explain(self) -> str:
        """How the bound in force came about (see :meth:`StallRule.explain`)."""
        if self.saving:
            return self.rule.explain_save(self.slowest_save_s, self.startup)
        return self.rule.explain(self.slowest_s, self.first_step, self.startup)

    @property
    def slowest_s(self) -> float:
        return max(self.durations, default=0.0)

    @property
    def last_step_s(self) -> float | None:
        return self.durations[-1] if self.durations else None

    def where(self) -> str:
        """The current step, as the error names it: ``"in batch 3 of epoch 0"``, or ``"after batch 3 ..."`` between
        steps."""
        if self.batch is None:
            return "while saving a checkpoint before the first training step" if self.saving else (
                "before the first training step")
        if self.saving:
            return f"while saving a checkpoint after batch {self.batch} of epoch {self.epoch}"
        return f"{'after' if self._ended else 'in'} batch {self.batch} of epoch {self.epoch}"


@dataclass(frozen=True)
class Wait:
    """What a rank waits for, and on whom: ``peers`` are the ranks that must act for the wait to end."""

    what: str  # "the activation of micro-batch 3", "the sum of the gradients over the pipeline"
    peers: tuple[int, ...]
    sending: bool = False  # the rank waits for its peers to take what it sent

    def describe(self, name_of: Mapping[int, str]) -> str:
        """``"for the activation of micro-batch 3 from stage 0 (rank 1)"``, ``name_of`` naming each rank."""
        peers = " and ".join(name_of.get(peer, f"rank {peer}") for peer in self.peers) or "the other ranks"
        return f"for {peers} to receive {self.what}" if self.sending else f"for {self.what} from {peers}"


@dataclass
class RankState:
    """One rank's answer when the watchdog fires: whether and for what it waits, for how long, where it is."""

    rank: int
    name: str  # "stage 0 (rank 1)"
    waiting: str | None  # "for the activation of micro-batch 0 from stage 0 (rank 1)", if in a pipeline wait
    peers: list[int]  # the ranks it waits on
    seconds: float  # how long it has waited, or, when not waiting, since it last made progress
    location: str  # where its main thread is: "train.py:12 in on_train_batch_end"
    collective: str | None  # a torch.distributed call it is in that the pipeline did not make (Lightning's, a user's)
    step: str  # "in batch 3 of epoch 0"
    last_step_s: float | None
    bound_s: float | None
    stacks: str  # the file its stack was written to
    note: str = ""  # how the bound came about (the rank that fired)
    first_step: bool = False  # the bound was a first step's

    @property
    def stopped(self) -> bool:
        """Waits on no other rank: it runs code of its own (or is stuck in it)."""
        return not self.peers and self.collective is None

    def line(self) -> str:
        if self.waiting is not None:
            return f"{self.name} waited {self.seconds:.1f} s {self.waiting}"
        if self.collective is not None:
            return f"{self.name} waited {self.seconds:.1f} s in {self.collective}"
        return f"{self.name} waits on no other rank; no progress for {self.seconds:.1f} s, at {self.location}"


@dataclass
class Verdict:
    """All ranks' answers (``None``: no answer), the ranks found stopped, and the rank that fired first."""

    states: dict[int, RankState | None]
    stalled: list[int] = field(default_factory=list)
    fired_by: int | None = None

    def name(self, rank: int) -> str:
        state = self.states.get(rank)
        return state.name if state is not None else f"rank {rank}"


def stalled_ranks(states: Mapping[int, RankState | None]) -> list[int]:
    """The ranks that stopped: awaited by another rank while waiting on none (or not answering).

    A rank waiting in a collective the pipeline did not make waits on someone it cannot name: it is not a suspect. If
    no awaited rank stopped (the waits name no one, e.g. every waiting rank is in such a collective), every rank that
    waits on no one is. If every rank waits, the list is empty: the ranks wait on each other (they disagree on what
    comes next).
    """

    def stopped(rank: int) -> bool:
        state = states.get(rank)
        return state is None or state.stopped

    awaited = {peer for state in states.values() if state is not None for peer in state.peers}
    return sorted(rank for rank in awaited if stopped(rank)) or sorted(rank for rank in states if stopped(rank))


def stall_message(own: RankState, verdict: Verdict, stacks_dir: str) -> str:
    """The error of one rank: its own wait (or, for the rank that stopped, where it stopped), the wait that fired the
    watchdog against the bound, the rank that stopped, who waited on whom, and where the stacks are."""
    fired = verdict.states.get(verdict.fired_by) if verdict.fired_by is not None else None
    fired = fired or own
    if own.rank in verdict.stalled:
        head = f"{own.name} stopped making progress {own.step} (at {own.location}); the stall watchdog ended it."
    elif own.rank == fired.rank:
        head = f"{own.line()} {own.step}."
    else:
        head = f"{own.line()} {own.step}, when the stall watchdog ended the run."
    bound = f"{fired.bound_s:.1f} s" if fired.bound_s is not None else "the bound"
    how = f" ({fired.note})" if fired.note else ""
    last = f"the last training step took {fired.last_step_s:.2f} s" if fired.last_step_s is not None else (
        "no training step was timed yet"
    )
    lines = [head, f"The watchdog fired as {fired.line()}, longer than its bound of {bound}{how}; {last}."]
    if verdict.stalled:
        names = ", ".join(verdict.name(rank) for rank in verdict.stalled)
        lines.append(f"The rank that stopped: {names} (awaited, and waiting on no other rank).")
    else:
        lines.append("Every rank waits on another: they disagree on what comes next (a step taken on some ranks only?).")
    lines.append("Who waited on whom when the watchdog fired:")
    for rank in sorted(verdict.states):
        state = verdict.states[rank]
        lines.append(f"  {state.line() if state is not None else f'rank {rank} did not answer'}")
    raise_it = "GPipeStrategy(stall_first_step=...)" if fired.first_step else (
        "GPipeStrategy(stall_floor=...) or stall_multiple=..."
    )
    lines.append(
        f"Every rank's Python stack is in {stacks_dir}. If such a wait is legitimate, raise {raise_it}, or turn the"
        " watchdog off with stall_watchdog=False."
    )
    return "\n".join(lines)
