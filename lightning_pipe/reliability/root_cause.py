"""The root cause of a failed run, on every rank: the exception of the stage that failed first, not the lost-peer
error that its neighbours see next.

The rank whose own code raises first records its exception in the store all ranks share; a rank that fails because
it lost that peer re-raises the recorded exception (:func:`raising_the_root_cause`); after the stall watchdog ended the
run, it raises its own stall error, which names the rank that stopped; where the peer ended without a Python error
(killed) inside a collective, whose error does not say which rank it lost, it names the rank that is gone
(:mod:`~lightning_pipe.reliability.lost_ranks`). Under spawn and fork, the
launching process raises a failed rank's exception itself instead of torch's text (:func:`leaving_the_exception`,
:func:`left_exception`).
"""

from __future__ import annotations

import base64
import itertools
import os
import pickle
import traceback
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from lightning.pytorch import Trainer

from lightning_pipe.reliability.lost_ranks import lost_rank_message
from lightning_pipe.reliability.stop_signals import stop_exception
from lightning_pipe.reliability.watchdog import stall_found_here

_FAILURE_KEY = "lightning_pipe/first_failure"
_launches = itertools.count()  # this process's trainer calls, numbered alike on every rank


def next_failure_key() -> str:
    """Where the n-th trainer call of this process records its failure: every rank makes the same calls in the
    same order, so the n-th launch has the same key on every rank."""
    return f"{_FAILURE_KEY}/{next(_launches)}"


@dataclass
class RecordedFailure:
    """The first exception raised on any rank of a run (other than by losing a peer), as the other ranks read it."""

    rank: int
    stage: int | None
    exception: bytes | None  # pickled, or None where the exception does not pickle
    summary: str  # "Type: message"
    traceback: str


class StageTraceback(Exception):
    """The traceback of an exception raised in another rank's process (the cause of the same exception here)."""

    def __init__(self, failure: RecordedFailure) -> None:
        super().__init__(failure)
        self.failure = failure

    def __str__(self) -> str:
        return f"on {_who(self.failure.rank, self.failure.stage)}:\n\n{self.failure.traceback}"


class PipelineStageError(RuntimeError):
    """Another stage's exception, re-raised where it could not be re-created (its class does not unpickle)."""


class PipelineCommunicationError(RuntimeError):
    """A wait on a neighbouring stage failed: it timed out, or the neighbour's process ended."""


def raising_the_root_cause(function: Callable, trainer: Trainer | None, key: str, *args: Any, **kwargs: Any) -> Any:
    """Run ``function`` (a trainer's fit, validate, ...) on this rank, so that a failed run ends with its cause.

    The rank whose own code raises first records its exception, before its process ends, in the store that all
    ranks share (the process group's TCPStore); its neighbours only then lose it, so a rank that fails because it
    lost a peer finds the record and raises the recorded exception instead: the user's terminal, the launching
    process's error and every rank's error show the stage that failed, its exception and where it was raised.
    """
    try:
        return function(*args, **kwargs)
    except Exception as error:
        if not lost_a_peer(error):
            _record(key, error, trainer)
            raise
        stall = stall_found_here()
        if stall is not None:
            raise stall from error
        stop = stop_exception(error)
        if stop is not None:  # its waits failed because the rank was told to stop (SIGTERM, SIGINT)
            raise stop from error
        recorded = _recorded(key)
        if recorded is None and not _names_its_peer(error):  # a peer that ended without a Python error
            raise PipelineCommunicationError(lost_rank_message(error, _who(_rank(), _stage(trainer)))) from error
        if recorded is None or recorded.rank == _rank():
            raise
        raise _recreated(recorded, error, trainer) from StageTraceback(recorded)


def leaving_the_exception(directory: str, function: Callable, *args: Any, **kwargs: Any) -> Any:
    """Run ``function`` in a rank started by spawn or fork; leave the exception it ends with in ``directory``, for
    the launching process (the rank's index names the file, as torch's error names the rank)."""
    try:
        return function(*args, **kwargs)
    except Exception as error:
        with suppress(Exception):  # an exception that does not pickle stays torch's text
            with open(os.path.join(directory, os.environ.get("LOCAL_RANK", "0")), "wb") as file:
                pickle.dump(error, file)
        raise


class _LaunchingProcessUnpickler(pickle.Unpickler):
    """Classes of the script a spawned rank ran as ``__mp_main__`` are the launching process's ``__main__``."""

    def find_class(self, module: str, name: str) -> Any:
        return super().find_class("__main__" if module == "__mp_main__" else module, name)


def left_exception(path: str) -> BaseException | None:
    with suppress(Exception), open(path, "rb") as file:
        exception = _LaunchingProcessUnpickler(file).load()
        return exception if isinstance(exception, BaseException) else None
    return None


def lost_a_peer(error: BaseException) -> bool:
    """Whether ``error`` follows from another rank's failure: a wait on a stage or a collective that lost a peer, or
    whose connections the stall watchdog closed (gloo: "Application timeout caused pair closure")."""
    while error is not None:
        if isinstance(error, (PipelineCommunicationError, dist.DistError)):
            return True
        text = str(error).lower()
        if isinstance(error, RuntimeError) and any(
            cause in text
            for cause in ("connection closed by peer", "connection reset by peer", "broken pipe", "caused pair closure")
        ):
            return True
        error = error.__cause__  # type: ignore[assignment]
    return False


def _names_its_peer(error: BaseException | None) -> bool:
    """Whether ``error`` is (or follows from) a failed wait that names the rank it waited on."""
    while error is not None:
        if isinstance(error, PipelineCommunicationError):
            return True
        error = error.__cause__
    return False


def _store() -> dist.Store | None:
    return dist.distributed_c10d._get_default_store() if dist.is_available() and dist.is_initialized() else None


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _stage(trainer: Trainer | None) -> int | None:
    try:
        return trainer.strategy.stage_index  # type: ignore[union-attr]
    except Exception:  # noqa: BLE001  (not a pipeline strategy, or failed before its stages existed)
        return None


def _who(rank: int, stage: int | None) -> str:
    return f"rank {rank}" if stage is None else f"stage {stage} (rank {rank})"


def _record(key: str, error: BaseException, trainer: Trainer | None) -> None:
    """Record ``error`` under ``key`` unless another rank's failure is recorded there already. Best effort: a store
    that is gone (its rank 0 failed first) leaves this rank's own error as it is."""
    store = _store()
    if store is None:
        return
    try:
        pickled: bytes | None = pickle.dumps(error)
        pickle.loads(pickled)
    except Exception:  # noqa: BLE001  (an exception that does not survive pickling is re-raised as text)
        pickled = None
    formatted = "".join(traceback.format_exception(error))
    failure = RecordedFailure(_rank(), _stage(trainer), pickled, f"{type(error).__name__}: {error}", formatted)
    with suppress(Exception):
        # compare_set answers, unlike set: the record is in the store before this process ends and its peers see it
        store.compare_set(key, "", base64.b64encode(pickle.dumps(failure)).decode())


def _recorded(key: str) -> RecordedFailure | None:
    store = _store()
    try:
        if store is None or not store.check([key]):
            return None
        return pickle.loads(base64.b64decode(store.get(key)))
    except Exception:  # noqa: BLE001  (the store went with the rank that held it: nothing to learn)
        return None


def _recreated(recorded: RecordedFailure, lost: BaseException, trainer: Trainer | None) -> BaseException:
    """The recorded exception, re-created here, with a note on how it reached this rank."""
    note = (
        f"raised on {_who(recorded.rank, recorded.stage)}; {_who(_rank(), _stage(trainer))} then lost that stage"
        f" ({type(lost).__name__}) and raises it again here, the run's cause"
    )
    exception: BaseException | None = None
    if recorded.exception is not None:
        with suppress(Exception):
            exception = pickle.loads(recorded.exception)
    if not isinstance(exception, BaseException):
        exception = PipelineStageError(f"{recorded.summary} (raised on {_who(recorded.rank, recorded.stage)})")
    exception.add_note(note)
    return exception
