"""The stall watchdog at run time: waits on other ranks bounded, who stopped found from every rank's answer, every
rank's stack written, the run ended.

The rule (the bound, which steps it applies to, who stopped) is :mod:`lightning_pipe.reliability.stall_rule`; this
module applies it in a run. Two things watch a rank:

* Its waits. Every wait of the pipeline on another rank comes through :meth:`StallWatchdog.wait` (the works of
  point-to-point messages and of the strategy's collectives, with what is awaited and from whom) or
  :meth:`StallWatchdog.waiting` (a call that waits inside, such as the broadcast of a step's results). A wait stays a
  plain, untimed wait: the main thread only notes what it waits for and since when (two attribute writes), so that
  the watchdog costs nothing measurable per wait.
* A thread of its own, the watcher, which keeps the deadline. Every half second it asks the store that
  ``torch.distributed`` already runs (rank 0's TCPStore) whether another rank fired, and checks the main thread's
  wait against the bound: a wait that outlasted it, a rank stuck in a wait the pipeline does not make (Lightning's
  per-step broadcast, a user's collective), fires from here.

When a rank fires, every rank answers through the store with its state (what it waits for and on whom, or where its
main thread is) and writes its Python stack (all threads, ``faulthandler``) to its log and to
``<default_root_dir>/stall_stacks/rank<R>.txt``. From the answers the rank that stopped is found (awaited, waiting on
no one), and each rank ends with a :class:`~lightning_pipe.reliability.stall_rule.PipelineStallError` that names its own
wait and that rank. A waiting rank's watcher closes the rank's gloo connections (:func:`close_gloo_groups`, what gloo
itself does when a timed wait expires), so that the wait in its main thread fails and raises the error; the stopped
rank's watcher raises it in its main thread (a signal interrupts a sleep, a lock or a blocking read). Either watcher
ends its process if that does not end it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import itertools
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterable, Iterator, Mapping
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_pipe.reliability.stall_rule import (
    PipelineStallError,
    RankState,
    StallRule,
    StartUp,
    StepClock,
    Verdict,
    Wait,
    stall_message,
    stalled_ranks,
)

TICK_S = 0.5  # how often the watcher looks at the store and at its rank's progress
ANSWER_GRACE_S = 3.0  # how long a firing rank waits for the others' answers
ENDING_GRACE_S = 10.0  # how long the stopped rank's raised error may take to end its process before it is ended
LINGER_S = 30.0  # how long any rank may live on after the verdict before its watcher ends it
_CLOSING_TAG = 0x5A11  # the tag of the receive that closes a gloo group (no message is ever sent with it)
STACKS_DIR = "stall_stacks"
_SIGNAL = signal.SIGUSR2  # sent to the stopped rank's main thread, whose handler raises the error there
_runs = itertools.count()  # this process's watched runs, numbered alike on every rank (each trainer call sets one up)
_latest: list[StallWatchdog] = []  # the watchdog of this process's latest run, for stall_found_here()


class StallWatchdog:
    """Watches one rank's waits during a run; one per rank and trainer call. ``rule=None`` watches nothing: waits are
    plain waits (:data:`UNWATCHED`).

    ``names`` names every global rank as errors do (``"stage 0 (rank 1)"``); ``hard_timeout`` is the process groups'
    timeout, which stays in force where it is shorter than the bound.
    """

    def __init__(
        self,
        rule: StallRule | None,
        rank: int = 0,
        names: Mapping[int, str] | None = None,
        hard_timeout: timedelta | None = None,
    ) -> None:
        self.clock = StepClock(rule) if rule is not None else None
        self.rank = rank
        self.names = dict(names or {})
        self._hard_timeout_s = hard_timeout.total_seconds() if hard_timeout is not None else None
        self._key = f"lightning_pipe/stall/{next(_runs)}" if rule is not None else ""
        self._current: tuple[Wait, float] | None = None  # the main thread's wait in progress and its start
        self._since = time.monotonic()  # the main thread's last progress
        self._peers: dict[int, tuple[int, ...]] = {}  # group id -> the other ranks of the group
        self._lock = threading.Lock()
        self._verdict: Verdict | None = None
        self._own: RankState | None = None
        self._ending: PipelineStallError | None = None  # raised in the main thread by the signal handler
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._main_thread: int | None = None
        self._previous_handler: Any = None
        self._handling_signal = False
        self._stacks_dir: Path | None = None

    def __getstate__(self) -> dict[str, Any]:
        """The spawn launcher pickles the strategy: a watchdog travels without its thread, lock and handler."""
        state = self.__dict__.copy()
        state.update(_lock=None, _stop=None, _watcher=None, _handling_signal=False, _previous_handler=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock(), _stop=threading.Event())

    # ---- the run (main thread) ----------------------------------------------------------------------------------

    def start(self, run_dir: Path) -> None:
        """Start watching: the watcher thread, the stacks' directory ``run_dir/stall_stacks``, the ending signal."""
        if self.clock is None or self._watcher is not None or not dist.is_initialized():
            return
        self._stacks_dir = Path(run_dir) / STACKS_DIR
        self._main_thread = threading.get_ident()
        _latest[:] = [self]
        if threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(_SIGNAL, self._on_signal)
            self._handling_signal = True
        store = dist.distributed_c10d._get_default_store().clone()  # a connection of its own: it polls from a thread
        self._stop.clear()
        self._watcher = threading.Thread(target=self._watch, args=(store,), name="lightning_pipe-stall-watcher",
                                         daemon=True)
        self._watcher.start()

    def stop(self) -> None:
        """Stop watching (at teardown): the watcher ends, the signal gets its previous handler back."""
        self._stop.set()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=2 * TICK_S + 1)
        self._watcher = None
        if self._handling_signal:
            with contextlib.suppress(ValueError):  # not the main thread: the handler stays (it passes the signal on)
                signal.signal(_SIGNAL, self._previous_handler if self._previous_handler is not None else signal.SIG_DFL)
                self._handling_signal = False

    def startup_measured(self, startup: StartUp) -> None:
        """What the set-up measured, from which the first steps' bound is derived (see :class:`StallRule`)."""
        if self.clock is not None:
            self.clock.startup = startup

    def step_starts(self, epoch: int, batch: int, batch_shape: Any) -> None:
        if self.clock is not None:
            self._since = now = time.monotonic()
            self.clock.step_starts(now, epoch, batch, batch_shape)

    def uneven_phase(self) -> None:
        """Validation, a checkpoint, an epoch's end, the run's end: nothing is bounded until the next regular step."""
        if self.clock is not None:
            self.clock.uneven_phase()

    def checkpoint_phase(self, sharded: bool) -> None:
        """A checkpoint's save begins or goes on. A sharded save, every rank writing its part, is bounded by the
        save's bound (see :meth:`~lightning_pipe.reliability.stall_rule.StallRule.save_bound_s`) until the next step;
        a one-file checkpoint, gathered and written by rank 0 while the others wait, is an uneven phase."""
        if self.clock is None:
            return
        if not sharded:
            self.clock.uneven_phase()
            return
        now = time.monotonic()
        if not self.clock.saving:
            self._since = now
        self.clock.save_starts(now)

    def save_ends(self) -> None:
        """The save is committed: it is timed, for the next saves' bound."""
        self._since = now = time.monotonic()
        if self.clock is not None:
            self.clock.save_ends(now)

    def step_ends(self) -> None:
        """The step's optimizer step is done: the time until the next step (callbacks, the next batch) is watched from
        here."""
        self._since = time.monotonic()
        if self.clock is not None:
            self.clock.step_ends()

    # ---- waits ---------------------------------------------------------------------------------------------------

    def wait(self, works: Iterable[dist.Work], waited: Wait, group: dist.ProcessGroup | None = None) -> None:
        """Wait for ``works`` (of ``group``, named by callers for the reader; every group is treated alike). The waits
        are plain, untimed ones: the watcher bounds them (see the module). A wait that fails once a stall was found
        raises :class:`PipelineStallError`; any other failure raises the backend's error."""
        if self.clock is None:
            for work in works:
                work.wait()
            return
        # What `waiting` does, written out: its generator costs microseconds on every wait of every step.
        start = time.monotonic()
        self._current = (waited, start)
        try:
            for work in works:
                work.wait()
        except RuntimeError as error:
            stall = self._stall_error(waited, start)
            if stall is None:
                raise
            raise stall from error
        finally:
            self._current = None
            self._since = time.monotonic()

    @contextlib.contextmanager
    def waiting(self, waited: Wait) -> Iterator[None]:
        """Mark a wait on other ranks, for calls that wait inside (``broadcast_object_list``), as :meth:`wait` does."""
        start = time.monotonic()
        self._current = (waited, start)
        try:
            yield
        except RuntimeError as error:
            stall = self._stall_error(waited, start)
            if stall is None:
                raise
            raise stall from error
        finally:
            self._current = None
            self._since = time.monotonic()

    def collective(self, what: str, group: dist.ProcessGroup, sending: bool = False) -> Wait:
        """The wait of a collective over ``group``: on its other ranks."""
        if self.clock is None:
            return Wait(what, (), sending)
        key = id(group)
        if key not in self._peers:
            self._peers[key] = tuple(r for r in dist.get_process_group_ranks(group) if r != self.rank)
        return Wait(what, self._peers[key], sending)

    def _bound_s(self) -> float | None:
        """The bound on a wait now; ``None`` when not armed, or when the hard timeout is the shorter."""
        bound = self.clock.bound_s if self.clock is not None and self._watcher is not None else None
        if bound is None or (self._hard_timeout_s is not None and bound >= self._hard_timeout_s):
            return None
        return bound

    def _stall_error(self, waited: Wait, start: float) -> PipelineStallError | None:
        """The error of a wait that failed after a stall was found: its connection closed by a watcher (this rank's
        or another's) or lost with the stopped rank's process."""
        own = self._state(waited, time.monotonic() - start)
        with self._lock:  # the watcher may be settling right now
            verdict = self._verdict
        store = _default_store()
        if verdict is None:
            verdict = self._published_verdict(store)
        bound = self.clock.bound_s if self.clock is not None else None
        if verdict is None and bound is not None and own.seconds >= bound / 2 and self._fired_soon(store):
            # A waiting rank's watcher closes its connections once the verdict is out, which fails the waits of its
            # peers: a wait as long as this one (a crashed peer fails the others' waits early) may have failed on
            # one before this rank read the verdict. Answer it and end with the verdict, not with the lost connection.
            verdict = self._settle(store, own)
        if verdict is None:
            return None
        return PipelineStallError(self._message(own, verdict))

    # ---- firing, answering, the verdict ---------------------------------------------------------------------------

    def _state(self, waited: Wait | None = None, seconds: float | None = None) -> RankState:
        """This rank's answer: its wait (``waited``, or the one in progress), or where its main thread is."""
        assert self.clock is not None
        now = time.monotonic()
        if waited is None and (current := self._current) is not None:
            waited, start = current
            seconds = now - start
        location, collective = self._main_thread_location()
        bound = self.clock.bound_s
        return RankState(
            rank=self.rank,
            name=self._name(self.rank),
            waiting=waited.describe(self.names) if waited is not None else None,
            peers=list(waited.peers) if waited is not None else [],
            seconds=seconds if seconds is not None else now - self._since,
            location=location,
            collective=collective if waited is None else None,
            step=self.clock.where(),
            last_step_s=self.clock.last_step_s,
            bound_s=bound,
            stacks=str(self._stacks_file()),
            note=self.clock.explain() if bound is not None else "",
            first_step=self.clock.first_step,
        )

    def _main_thread_location(self) -> tuple[str, str | None]:
        frame = sys._current_frames().get(self._main_thread or threading.get_ident())
        return main_thread_location(traceback.extract_stack(frame) if frame is not None else [])

    def _settle(self, store: dist.Store | None, own: RankState) -> Verdict:
        """Fire (or answer another rank's firing): publish this rank's state, write its stacks, collect every rank's
        state and agree on one verdict (the first one written to the store). Without the store (it went with rank
        0's process), decide with this rank's own state."""
        with self._lock:
            if self._verdict is not None:
                return self._verdict
            self._own = own
            fired_by = self._publish(store, own)
            self._write_stacks()
            if store is None or fired_by is None:
                verdict = Verdict({self.rank: own}, stalled_ranks({self.rank: own}), self.rank)
            else:
                states = self._answers(store)
                verdict = self._agreed(store, Verdict(states, stalled_ranks(states), fired_by))
            self._verdict = verdict
            return verdict

    def _publish(self, store: dist.Store | None, own: RankState) -> int | None:
        """Publish this rank's state and mark the run as fired; the rank that fired first (``None``: no store)."""
        with contextlib.suppress(Exception):
            if store is not None:
                store.set(f"{self._key}/state/{self.rank}", json.dumps(dataclasses.asdict(own)))
                return int(store.compare_set(f"{self._key}/fired", "", str(self.rank)).decode())
        return None

    def _agreed(self, store: dist.Store, verdict: Verdict) -> Verdict:
        """The verdict written first: every rank ends with the same one."""
        with contextlib.suppress(Exception):
            store.compare_set(f"{self._key}/verdict", "", _encode(verdict))
            return _decode(store.get(f"{self._key}/verdict").decode())
        return verdict

    def _answers(self, store: dist.Store) -> dict[int, RankState | None]:
        """Every rank's published state, waiting up to ``ANSWER_GRACE_S`` for them (``None``: no answer)."""
        keys = {rank: f"{self._key}/state/{rank}" for rank in range(dist.get_world_size())}
        answers: dict[int, RankState | None] = dict.fromkeys(keys)
        with contextlib.suppress(Exception):
            deadline = time.monotonic() + ANSWER_GRACE_S
            while not store.check(list(keys.values())) and time.monotonic() < deadline:
                time.sleep(0.1)
            for rank, key in keys.items():
                if store.check([key]):
                    answers[rank] = RankState(**json.loads(store.get(key).decode()))
        answers[self.rank] = self._own
        return answers

    def _fired_soon(self, store: dist.Store | None) -> bool:
        """Whether a rank fires within ``ANSWER_GRACE_S`` (or fired already)."""
        deadline = time.monotonic() + ANSWER_GRACE_S
        with contextlib.suppress(Exception):
            while store is not None:
                if store.check([f"{self._key}/fired"]):
                    return True
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
        return False

    def _published_verdict(self, store: dist.Store | None) -> Verdict | None:
        with contextlib.suppress(Exception):
            if store is not None and store.check([f"{self._key}/verdict"]):
                return _decode(store.get(f"{self._key}/verdict").decode())
        return None

    def _message(self, own: RankState, verdict: Verdict) -> str:
        return stall_message(own, verdict, str(self._stacks_file().parent))

    # ---- the watcher thread --------------------------------------------------------------------------------------

    def _watch(self, store: dist.Store) -> None:
        """Every ``TICK_S``: answer another rank's firing, or fire if this rank made no progress within the bound; once
        a verdict is known, end this rank if it is the one that stopped."""
        try:
            while not self._stop.wait(TICK_S):
                if self._verdict is None:
                    if store.check([f"{self._key}/fired"]) or self._overdue():
                        self._settle(store, self._state())
                if self._verdict is not None:
                    self._end(self._verdict)
                    return
        except Exception:  # noqa: BLE001  (the store is gone: the run is over, nothing left to watch)
            return

    def _overdue(self) -> bool:
        """A wait on other ranks outlasted the bound: one of the pipeline's, or a ``torch.distributed`` call the
        pipeline does not make (Lightning's per-step broadcast, a user's collective) with no progress since. A rank
        running its own code, however long, is not waiting: if it is stuck, the ranks waiting on it fire."""
        bound = self._bound_s()
        if bound is None:
            return False
        current = self._current
        if current is None:
            return time.monotonic() - self._since > bound and self._main_thread_location()[1] is not None
        return time.monotonic() - current[1] > bound

    def _end(self, verdict: Verdict) -> None:
        """Once the others had a moment to read the verdict, the stopped rank raises the error in its main thread and
        every other rank closes its gloo connections, which fails the wait its main thread is in (the wait raises the
        error) and the waits of its peers. A process that still runs ``ENDING_GRACE_S`` later (the stopped rank) or
        ``LINGER_S`` later (any other: a wait on NCCL, or a long computation that does not wait) is ended here."""
        own = self._own or self._state()
        message = self._message(own, verdict)
        stopped = self.rank in verdict.stalled
        if stopped:
            sys.stderr.write(f"\n{PipelineStallError.__name__}: {message}\n")
            sys.stderr.flush()
        if self._stop.wait(2 * TICK_S):
            return
        if not stopped:
            close_gloo_groups()
        elif self._handling_signal and self._main_thread is not None:
            self._ending = PipelineStallError(message)
            signal.pthread_kill(self._main_thread, _SIGNAL)
        if self._stop.wait(ENDING_GRACE_S if stopped else LINGER_S):
            return
        sys.stderr.write(f"\n{own.name} still runs after the stall watchdog ended the run; ending its process.\n")
        sys.stderr.flush()
        os._exit(1)

    def _on_signal(self, signum: int, frame: Any) -> None:
        ending, self._ending = self._ending, None
        if ending is not None:
            raise ending
        if callable(self._previous_handler):  # not ours: the handler the process had
            self._previous_handler(signum, frame)
        elif self._previous_handler == signal.SIG_DFL:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    # ---- stacks --------------------------------------------------------------------------------------------------

    def _stacks_file(self) -> Path:
        return (self._stacks_dir or Path(STACKS_DIR)) / f"rank{self.rank}.txt"

    def _write_stacks(self) -> None:
        """This rank's Python stack, every thread, to ``stall_stacks/rank<R>.txt`` and to its log (stderr)."""
        path = self._stacks_file()
        header = (
            f"Python stacks of {self._name(self.rank)} (pid {os.getpid()} on {socket.gethostname()}) when the stall"
            f" watchdog fired, {datetime.now().isoformat(timespec='seconds')}:\n"
        )
        with contextlib.suppress(OSError):
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as file:
                file.write(header)
                file.flush()
                faulthandler.dump_traceback(file, all_threads=True)
            sys.stderr.write("\n" + path.read_text())
            sys.stderr.flush()

    def _name(self, rank: int) -> str:
        return self.names.get(rank, f"rank {rank}")


UNWATCHED = StallWatchdog(None)  # plain waits: a run without the watchdog, or a single process


def stall_found_here() -> PipelineStallError | None:
    """This rank's error, if the watchdog of this process's latest run found a stall: what a rank raises when it then
    fails otherwise (it lost the stopped rank while posting a message, or in a wait of Lightning's)."""
    watchdog = _latest[0] if _latest else None
    if watchdog is None or watchdog._verdict is None or watchdog._own is None:
        return None
    return PipelineStallError(watchdog._message(watchdog._own, watchdog._verdict))


def main_thread_location(frames: list[traceback.FrameSummary]) -> tuple[str, str | None]:
    """Where a thread is (its innermost frame) and, if it is inside a ``torch.distributed`` call, which call and from
    where: ``("distributed_c10d.py:2830 in broadcast", "torch.distributed.broadcast (called from
    loops/training_epoch_loop.py:265 in _broadcast_sigterm_tensor)")``. Inside ``torch.distributed.checkpoint``
    only its collectives count: a rank writing its part of a sharded save waits on no one."""
    if not frames:
        return "unknown", None
    inside = [i for i, frame in enumerate(frames) if f"torch{os.sep}distributed{os.sep}" in frame.filename]
    in_c10d = any(frames[i].filename.endswith("distributed_c10d.py") for i in inside)
    if inside and not in_c10d and f"distributed{os.sep}checkpoint{os.sep}" in frames[inside[0]].filename:
        inside = []  # torch.distributed.checkpoint writing or reading this rank's own part: its own work, no wait
    collective = None
    if inside:
        first = inside[0]
        named = next((frames[i] for i in inside if frames[i].filename.endswith("distributed_c10d.py")), frames[first])
        collective = f"torch.distributed.{named.name}"
        if first > 0:
            collective += f" (called from {_short(frames[first - 1])})"
    return _short(frames[-1]), collective


def _short(frame: traceback.FrameSummary) -> str:
    return f"{os.sep.join(Path(frame.filename).parts[-2:])}:{frame.lineno} in {frame.name}"


def _default_store() -> dist.Store | None:
    """The default group's store (rank 0's TCPStore), or ``None`` when the group is gone."""
    with contextlib.suppress(Exception):
        return dist.distributed_c10d._get_default_store()
    return None


def close_gloo_groups() -> None:
    """Close the connections of every gloo process group of this process, from any thread: every wait on them (the
    main thread's included) fails at once, with gloo's "Application timeout caused pair closure", and so do the
    peers' waits on this rank ("Connection closed by peer").

    A thread cannot interrupt another's untimed gloo wait, and ``ProcessGroupGloo.abort`` (torch 2.13) leaves a
    pending wait blocked. A timed wait that expires is gloo's own way to abort: it closes every connection of its
    group. So each group gets a receive under a tag no one sends, and a wait of a millisecond on it (from a peer
    whose connection still works: see :func:`_close_gloo_group`). NCCL groups are left alone (their waits end with
    the process)."""
    with contextlib.suppress(Exception):
        me = dist.get_rank()
        for group in list(dist.distributed_c10d._world.pg_map):
            with contextlib.suppress(Exception):
                if dist.get_backend(group) != "gloo":
                    continue
                _close_gloo_group(group, me)


def _close_gloo_group(group: dist.ProcessGroup, me: int) -> None:
    """Close every connection of ``group`` by a timed receive that expires. A receive from a peer whose connection
    is already broken (its process was killed) fails at once with that error instead, and closes nothing else: the
    waits of the other ranks on this one would stay blocked. So each peer is tried in turn until a receive expires."""
    for peer in dist.get_process_group_ranks(group):
        if peer == me:
            continue
        try:
            dist.irecv(torch.empty(1), peer, group=group, tag=_CLOSING_TAG).wait(timedelta(milliseconds=1))
        except RuntimeError as error:  # the peer's broken connection (posting or waiting), or the expiry
            if "timed out" in str(error).lower():
                return  # expired: gloo closed every connection of the group
        else:
            return


def _encode(verdict: Verdict) -> str:
    states = {str(rank): dataclasses.asdict(state) if state is not None else None
              for rank, state in verdict.states.items()}
    return json.dumps({"stalled": verdict.stalled, "states": states, "fired_by": verdict.fired_by})


def _decode(text: str) -> Verdict:
    data = json.loads(text)
    states = {int(rank): RankState(**state) if state is not None else None for rank, state in data["states"].items()}
    return Verdict(states, data["stalled"], data["fired_by"])


def batch_shape(batch: Any) -> tuple[tuple[int, ...], ...]:
    """The shapes of a batch's tensors: a step whose batch has shapes no earlier step had is not bounded."""
    shapes: list[tuple[int, ...]] = []
    apply_to_collection(batch, Tensor, lambda t: shapes.append(tuple(t.shape)))
    return tuple(shapes)
