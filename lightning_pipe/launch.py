"""Starting the ranks and ending them: launchers that check the model first, SIGTERM, and the ranks of a failed run.

Lightning's launchers start one process per rank. The checked launchers raise the partition's errors in the
launching process, before any rank starts. When a run fails or is told to stop, a rank may be blocked in a receive
from a stage that is gone: what follows makes every rank end, soon, instead of waiting for a peer that never comes.
And every rank ends with the run's cause: the exception of the stage that failed first (:class:`RootCause`), not
the lost-peer error that its neighbours see next.
"""

from __future__ import annotations

import atexit
import base64
import itertools
import logging
import os
import pickle
import signal
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.plugins.environments import TorchElasticEnvironment
from lightning.fabric.utilities.distributed import _destroy_dist_connection
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.multiprocessing.spawn import ProcessRaisedException

from lightning_pipe.materialize import holds_meta_tensors, mark_held_elsewhere
from lightning_pipe.p2p import PipelineCommunicationError

log = logging.getLogger(__name__)

# After a failed run, how long the ranks a popen launch started may take to exit on their own before they are killed.
_STARTED_RANKS_GRACE_S = 3.0


class ModelCheck:
    """A launcher mixin: check the model before launching, so that bad input fails in the launching process; and run
    the trainer's function on every rank under :func:`raising_the_root_cause`."""

    check_model: Callable[[LightningModule, Trainer | None], None] | None = None
    _exceptions_dir: str | None = None  # where ranks started by spawn or fork leave the exception they end with

    def launch(self, function: Callable, *args: Any, trainer: Trainer | None = None, **kwargs: Any) -> Any:
        if self.check_model is not None and args and isinstance(args[0], LightningModule):
            self.check_model(args[0], trainer)
        # Every rank makes the same trainer calls in the same order: the n-th launch has the same key on every rank.
        function = partial(raising_the_root_cause, function, trainer, f"{_FAILURE_KEY}/{next(_launches)}")
        if self._exceptions_dir is not None:
            function = partial(_leaving_the_exception, self._exceptions_dir, function)
        return super().launch(function, *args, trainer=trainer, **kwargs)  # type: ignore[misc]


class CheckedSubprocessScriptLauncher(ModelCheck, _SubprocessScriptLauncher):
    pass


class CheckedMultiProcessingLauncher(ModelCheck, _MultiProcessingLauncher):
    def launch(self, function: Callable, *args: Any, trainer: Trainer | None = None, **kwargs: Any) -> Any:
        """torch raises a failed rank's traceback in the launching process as text (``ProcessRaisedException``):
        raise the rank's exception itself, as under the default launcher, with torch's text as its cause."""
        with tempfile.TemporaryDirectory(prefix="lightning_pipe_exceptions_") as directory:
            self._exceptions_dir = directory
            try:
                return super().launch(function, *args, trainer=trainer, **kwargs)
            except ProcessRaisedException as error:
                path = os.path.join(directory, str(error.error_index))
                exception = _unpickled(path) if os.path.exists(path) else None
                if exception is None:
                    raise
                raise exception from error
            finally:
                self._exceptions_dir = None

    def _recover_results_in_main_process(self, worker_output: _WorkerOutput, trainer: Trainer) -> None:
        """Lightning loads rank 0's weights (the whole trained model) into the launching process's module leniently:
        layers built in ``configure_model`` do not exist here, layers made under ``init_module(empty_init=True)``
        are on the meta device, and either would silently stay so. Build the missing ones on the meta device and
        take the trained tensors in place of the meta ones, so that this process holds what rank 0 holds: the whole
        model as after a fit on one device, or, for a model built on the meta device (which stays distributed unless
        ``gather_model_after_run``), the last stage. The weights are loaded here, once; Lightning does the rest."""
        path = worker_output.weights_path
        if path is not None:
            module = trainer.lightning_module
            weights = self._strategy.checkpoint_io.load_checkpoint(path)
            if set(weights) - set(module.state_dict()) and is_overridden("configure_model", module, LightningModule):
                with torch.device("meta"):
                    module.configure_model()
            deferred = holds_meta_tensors(module)
            module.load_state_dict(weights, strict=False, assign=deferred)
            if deferred and holds_meta_tensors(module):
                self._keep_distributed(module)
            self._strategy.checkpoint_io.remove_checkpoint(path)
            worker_output = worker_output._replace(weights_path=None)
        super()._recover_results_in_main_process(worker_output, trainer)

    def _keep_distributed(self, module: LightningModule) -> None:
        """A model built on the meta device stays distributed after the run: this process received rank 0's stage.
        Its other layers stay on the meta device, marked so that no later run starts them afresh."""
        left = [name for name, t in module.state_dict().items() if t.is_meta]
        if getattr(self._strategy, "_gather_model_after_run", False):
            raise RuntimeError(
                f"after fit, {len(left)} tensors of the model ({left[0]}, ...) did not come back to the"
                " launching process; build them in __init__ or use the default start method (strategy='gpipe')"
            )
        mark_held_elsewhere([m for m in module.modules() if holds_meta_tensors(m, recurse=False)])
        rank_zero_info(
            f"The model was built on the meta device and stays distributed: this process holds the last stage's"
            f" trained layers, {len(left)} tensors ({left[0]}, ...) stay on the meta device. The trained model is in"
            " the run's checkpoints; pass GPipeStrategy(gather_model_after_run=True) to receive it whole here."
        )


def note_sigterm(
    trainer: Trainer,
    launcher: _Launcher | None,
    cluster_environment: ClusterEnvironment | None,
    global_rank: int,
    signum: Any,
    frame: Any,
) -> None:
    """Lightning's SIGTERM handling without its broadcast over all ranks from inside the signal handler.

    That broadcast waits for every rank, from wherever a rank happens to be: a rank waiting on a stage that is
    gone, or one stuck in user code, never joins, and a rank blocked in a pipeline receive cannot. The spawn
    launcher and torchrun's agent send SIGTERM when another rank failed: such a rank ends at once (as without a
    handler) instead of hanging until the launcher kills it (torch's spawn after 30 s). Under the default
    launcher or a cluster's, SIGTERM stops the run at the next training step on every rank: Lightning shares rank
    0's flag with every rank at the start of each step.
    """
    if isinstance(launcher, _MultiProcessingLauncher) or isinstance(cluster_environment, TorchElasticEnvironment):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    connector = trainer._signal_connector
    log.info(f"[rank: {global_rank}] Received SIGTERM: {signum}")
    if not connector.received_sigterm and launcher is not None:
        launcher.kill(signum)
    connector.received_sigterm = True


# Whether this process destroys its process groups at exit: set up with the groups, withdrawn after a failure.
_process_groups_at_exit = {"registered": False, "destroy": True}


def end_process_groups_at_exit() -> None:
    """Destroy the process groups when this rank's interpreter exits, unless a run failed (see
    :func:`keep_process_groups_at_exit`).

    A process group left to the interpreter's final clean-up can abort the process after a successful run
    (``terminate called without an active exception``, exit code -6): gloo's worker threads may release tensors
    when the interpreter is already gone. torch asks applications to destroy their groups before exiting; this does
    it at exit, so that a later ``trainer.test`` in the same process still finds them.
    """
    if not _process_groups_at_exit["registered"]:
        _process_groups_at_exit["registered"] = True
        atexit.register(lambda: _destroy_dist_connection() if _process_groups_at_exit["destroy"] else None)


def keep_process_groups_at_exit() -> None:
    """After a failed run, leave the groups alone at exit: a gloo group would wait there for receives from peers
    that may never answer, and the process must end."""
    _process_groups_at_exit["destroy"] = False


def end_started_ranks_at_exit(launcher: _Launcher | None) -> bool:
    """If this process started the node's other ranks (popen launcher), end them when it exits, for they must not
    outlive it; whether it did."""
    if isinstance(launcher, _SubprocessScriptLauncher) and launcher.procs:
        atexit.register(_end_started_ranks, launcher.procs)
        return True
    return False


def _end_started_ranks(procs: list[subprocess.Popen]) -> None:
    """At the exit of a launching process whose run failed: end the ranks it started that are still running.

    They wait on this process in a receive, or compute towards one, and would linger until the communication timeout
    (30 minutes by default) or, stuck in user code, forever. At exit, this process's error is already printed;
    a rank that caught the same error and is finishing gets a few seconds, then SIGKILL (a process blocked in a
    receive runs no Python signal handler). The ranks leave the list that Lightning's child-process observer
    watches first, so that it does not answer their end by killing this process.
    """
    started = list(procs)
    procs.clear()
    deadline = time.monotonic() + _STARTED_RANKS_GRACE_S
    for proc in started:
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---- the root cause of a failed run ---------------------------------------------------------------------------------

_FAILURE_KEY = "lightning_pipe/first_failure"
_launches = itertools.count()  # this process's trainer calls, numbered alike on every rank


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
        if not _lost_a_peer(error):
            _record(key, error, trainer)
            raise
        recorded = _recorded(key)
        if recorded is None or recorded.rank == _rank():
            raise
        raise _recreated(recorded, error, trainer) from StageTraceback(recorded)


def _leaving_the_exception(directory: str, function: Callable, *args: Any, **kwargs: Any) -> Any:
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


def _unpickled(path: str) -> BaseException | None:
    with suppress(Exception), open(path, "rb") as file:
        exception = _LaunchingProcessUnpickler(file).load()
        return exception if isinstance(exception, BaseException) else None
    return None


def _lost_a_peer(error: BaseException) -> bool:
    """Whether ``error`` follows from another rank's failure: a wait on a stage or a collective that lost a peer."""
    while error is not None:
        if isinstance(error, (PipelineCommunicationError, dist.DistError)):
            return True
        text = str(error).lower()
        if isinstance(error, RuntimeError) and any(
            cause in text for cause in ("connection closed by peer", "connection reset by peer", "broken pipe")
        ):
            return True
        error = error.__cause__  # type: ignore[assignment]
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
