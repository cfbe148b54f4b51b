"""Starting the ranks and ending them: launchers that check the model first, the process groups, the signals a rank
hears (SIGTERM, SIGINT, SLURM's requeue), and the ranks of a failed run.

Lightning's launchers start one process per rank. The checked launchers raise the partition's errors in the
launching process, before any rank starts. When a run fails or is told to stop, a rank may be blocked in a receive
from a stage that is gone: what follows makes every rank end, soon, instead of waiting for a peer that never comes.
And every rank ends with the run's cause (:mod:`~lightning_pipe.reliability.root_cause`).
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import signal
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from contextlib import suppress
from functools import partial
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins import ClusterEnvironment
from lightning.fabric.utilities.distributed import _destroy_dist_connection, _init_dist_connection
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.strategies.launchers.launcher import _Launcher
from lightning.pytorch.strategies.launchers.multiprocessing import _WorkerOutput
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.multiprocessing.spawn import ProcessRaisedException

from lightning_pipe.execution.materialize import holds_meta_tensors, mark_held_elsewhere
from lightning_pipe.execution.process_groups import PipelineGroups, init_pipeline_groups
from lightning_pipe.execution.runtime import StageRuntime
from lightning_pipe.integration.lightning_packages import lightning_module_base, overrides
from lightning_pipe.partition.topology import PipelineLayout
from lightning_pipe.reliability.root_cause import (
    left_exception,
    leaving_the_exception,
    next_failure_key,
    raising_the_root_cause,
)
from lightning_pipe.reliability.lost_ranks import publish_process
from lightning_pipe.reliability.stop_signals import StopSignals
from lightning_pipe.reliability.watchdog import UNWATCHED, StallWatchdog, close_gloo_groups
from lightning_pipe.settings import PipelineSettings

log = logging.getLogger(__name__)

# After a failed run, how long the ranks a popen launch started may take to exit on their own before they are killed.
_STARTED_RANKS_GRACE_S = 3.0
# After a started rank failed, how long the launching process may take to raise the run's cause before it is killed.
_FAILED_RANK_GRACE_S = 30.0


class ModelCheck:
    """A launcher mixin: check the model before launching, so that bad input fails in the launching process; and run
    the trainer's function on every rank under :func:`raising_the_root_cause`."""

    # Called with the model, the trainer and, as ``fit_loaders``, the function's next argument (a fit's
    # ``train_dataloaders``: the first batch's training step may show which blocks to pipeline).
    check_model: Callable[..., None] | None = None
    _exceptions_dir: str | None = None  # where ranks started by spawn or fork leave the exception they end with

    def launch(self, function: Callable, *args: Any, trainer: Trainer | None = None, **kwargs: Any) -> Any:
        if self.check_model is not None and args and lightning_module_base(args[0]) is not None:
            self.check_model(args[0], trainer, fit_loaders=args[1] if len(args) > 1 else None)
        function = partial(raising_the_root_cause, function, trainer, next_failure_key())
        # Lightning calls ``function`` once it has started the other ranks (popen launcher) and its observer.
        function = partial(_watching_started_ranks, self, function)
        if self._exceptions_dir is not None:
            function = partial(leaving_the_exception, self._exceptions_dir, function)
        return super().launch(function, *args, trainer=trainer, **kwargs)  # type: ignore[misc]


class SpawnedRanks(ModelCheck):
    """A launcher mixin for the spawn and fork start methods: the ranks' exceptions and trained weights come back to
    the launching process."""

    def launch(self, function: Callable, *args: Any, trainer: Trainer | None = None, **kwargs: Any) -> Any:
        """torch raises a failed rank's traceback in the launching process as text (``ProcessRaisedException``):
        raise the rank's exception itself, as under the default launcher, with torch's text as its cause."""
        with tempfile.TemporaryDirectory(prefix="lightning_pipe_exceptions_") as directory:
            self._exceptions_dir = directory
            try:
                return super().launch(function, *args, trainer=trainer, **kwargs)
            except ProcessRaisedException as error:
                path = os.path.join(directory, str(error.error_index))
                exception = left_exception(path) if os.path.exists(path) else None
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
            if set(weights) - set(module.state_dict()) and overrides(module, "configure_model"):
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
        Its other blocks stay on the meta device, marked so that no later run starts them afresh."""
        left = [name for name, t in module.state_dict().items() if t.is_meta]
        if getattr(self._strategy, "_gather_model_after_run", False):
            raise RuntimeError(
                f"after fit, {len(left)} tensors of the model ({left[0]}, ...) did not come back to the"
                " launching process; build them in __init__ or use the default start method (strategy='gpipe')"
            )
        mark_held_elsewhere([m for m in module.modules() if holds_meta_tensors(m, recurse=False)])
        rank_zero_info(
            f"The model was built on the meta device and stays distributed: this process holds the last stage's"
            f" trained blocks, {len(left)} tensors ({left[0]}, ...) stay on the meta device. The trained model is in"
            " the run's checkpoints; pass GPipeStrategy(gather_model_after_run=True) to receive it whole here."
        )


# The launchers of the `lightning` package (those of `pytorch_lightning` are in `lightning_pipe.standalone`).
class CheckedSubprocessScriptLauncher(ModelCheck, _SubprocessScriptLauncher):
    pass


class CheckedMultiProcessingLauncher(SpawnedRanks, _MultiProcessingLauncher):
    pass


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
    torchelastic = any(cls.__name__ == "TorchElasticEnvironment" for cls in type(cluster_environment).__mro__)
    if isinstance(launcher, SpawnedRanks) or torchelastic:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    connector = trainer._signal_connector
    log.info(f"[rank: {global_rank}] Received SIGTERM: {signum}")
    if not connector.received_sigterm and launcher is not None:
        launcher.kill(signum)
    connector.received_sigterm = True


def hear_signals(
    trainer: Trainer,
    launcher: _Launcher | None,
    cluster_environment: ClusterEnvironment | None,
    layout: PipelineLayout,
    rank: int,
    runtime: Callable[[], StageRuntime | None],
) -> StopSignals | None:
    """Hear SIGTERM, SIGINT and SLURM's requeue signal on a rank that may be blocked in a wait on a peer (see
    :func:`note_sigterm`, :func:`note_requeue` and :mod:`lightning_pipe.reliability.stop_signals`); what listens for
    the stop signals, to be stopped at teardown. ``runtime`` gives this rank's step runtime once it is built."""
    connector = trainer._signal_connector
    # The Trainer registers its SIGTERM handler right after the strategy's `setup`; see `note_sigterm`.
    connector._sigterm_notifier_fn = partial(note_sigterm, trainer, launcher, cluster_environment, rank)
    if layout.num_stages > 1:  # SLURM's requeue waits for a step boundary
        connector._slurm_sigusr_handler_fn = partial(note_requeue, runtime)
    if layout.world_size == 1:
        return None
    stop_signals = StopSignals(
        f"stage {layout.stage(rank)} (rank {rank})", lambda: list(getattr(launcher, "procs", None) or [])
    )
    stop_signals.start()
    return stop_signals


def note_requeue(runtime: Callable[[], StageRuntime | None], signum: Any, frame: Any) -> None:
    """SLURM's requeue signal (SIGUSR1). Lightning saves the hpc checkpoint and requeues from inside the handler,
    wherever each rank happens to be: mid-step, a rank's peers wait on it while it waits for them in the
    checkpoint's gathers. Counted instead: the last stage's count travels with its next step outcome, and every
    stage of the pipeline requeues (:func:`requeue_if_due`) at the start of the training step after it."""
    if (stage_runtime := runtime()) is not None:
        stage_runtime.note_requeue_asked()


def requeue_if_due(trainer: Trainer, runtime: StageRuntime | None) -> None:
    """Lightning's requeue (its SIGUSR1 handler), at the start of a training step, where a step outcome asked it."""
    if runtime is None or not runtime.take_due_requeue():
        return
    connector = trainer._signal_connector
    type(connector)._slurm_sigusr_handler_fn(connector, signal.SIGUSR1, None)  # type: ignore[arg-type]


def start_process_groups(
    cluster_environment: ClusterEnvironment, settings: PipelineSettings, layout: PipelineLayout, rank: int,
    device: torch.device, backend: str, timeout: timedelta | None,
) -> PipelineGroups:
    """Join the run's default process group, then build the pipeline's groups over it, their waits watched by a
    stall watchdog where the settings ask for one and there are several ranks."""
    device_id = device if device.type != "cpu" else None
    _init_dist_connection(cluster_environment, backend, timeout=timeout, device_id=device_id)
    world_size = layout.world_size
    names = {r: f"stage {layout.stage(r)} (rank {r})" for r in range(world_size)}
    if world_size > 1:
        publish_process(names[rank])  # so that a rank that dies in a collective can be named (see lost_ranks)
    watchdog = UNWATCHED
    if settings.stall_rule is not None and world_size > 1:
        watchdog = StallWatchdog(settings.stall_rule, rank, names, timeout)
    return init_pipeline_groups(layout, rank, device, backend, timeout, watchdog)


# Whether this process destroys its process groups at exit: set up with the groups, withdrawn after a failure; and
# what holds references to them (strategies), released first.
_process_groups_at_exit = {"registered": False, "destroy": True}
_group_holders: weakref.WeakSet = weakref.WeakSet()


def end_process_groups_at_exit(holder: Any) -> None:
    """Destroy the process groups when this rank's interpreter exits, unless a run failed (see
    :func:`keep_process_groups_at_exit`); ``holder.release_process_groups()`` drops its references to them first.

    A process group left to the interpreter's final clean-up can abort the process after a successful run
    (``terminate called without an active exception``, exit code -6): gloo's worker threads may release tensors
    when the interpreter is already gone. torch asks applications to destroy their groups before exiting; this does
    it at exit, so that a later ``trainer.test`` in the same process still finds them. A group is destroyed (its
    threads joined) only when nothing references it any more: hence the holders' release.
    """
    _group_holders.add(holder)
    if not _process_groups_at_exit["registered"]:
        _process_groups_at_exit["registered"] = True
        atexit.register(_end_process_groups)


def _end_process_groups() -> None:
    if not _process_groups_at_exit["destroy"]:
        return
    for holder in list(_group_holders):
        holder.release_process_groups()
    _destroy_dist_connection()
    # Free now, not at the interpreter's end, the groups that only reference cycles still hold: a module and its
    # stand-in, and objects that torch's own registries (a DeviceMesh) kept reachable until the groups were destroyed.
    # Without it, whether a group's threads still run at exit depended on when Python last collected.
    gc.collect()


def keep_process_groups_at_exit() -> None:
    """After a failed run, leave the groups alone at exit: a gloo group would wait there for receives from peers
    that may never answer, and the process must end."""
    _process_groups_at_exit["destroy"] = False


def _watching_started_ranks(launcher: _Launcher, function: Callable, *args: Any, **kwargs: Any) -> Any:
    """Run ``function``, watching the ranks that ``launcher`` started (popen launcher; others start none here)."""
    procs = getattr(launcher, "procs", None)
    if procs:
        _retire_lightning_observer(procs)
        watcher = threading.Thread(
            target=_watch_started_ranks, args=(procs, os.getpid()), name="lightning-pipe-rank-watcher", daemon=True
        )
        watcher.start()
    return function(*args, **kwargs)


def _retire_lightning_observer(procs: list[subprocess.Popen]) -> None:
    """Lightning's child-process observer of ``procs`` stops (at its next look, finding none to watch): the watcher
    of :func:`_watch_started_ranks` does its job.

    NOTE: within 5 s of a started rank's failure, the observer SIGKILLs the launching process (and every rank), so
    that none lingers. On a loaded machine that comes before the launching process has raised the run's cause: the
    user sees a bare SIGKILL instead of the failing stage's exception. Taking the failed rank out of the observer's
    list as soon as it fails still loses that race where the observer looks first (seen with a rank killed inside a
    sharded checkpoint's collectives, on 2 cores under a load of 10).
    """
    for thread in threading.enumerate():
        if getattr(thread, "_child_processes", None) is procs:
            thread._child_processes = []  # type: ignore[attr-defined]


def _watch_started_ranks(procs: list[subprocess.Popen], launching_pid: int) -> None:
    """Take a started rank that failed out of the list of started ranks (which Lightning's child-process observer
    watched, see :func:`_retire_lightning_observer`).

    The launching process ends on its own once it next waits on the failed rank (the peer is lost, the cause
    re-raised); only if it is still running ``_FAILED_RANK_GRACE_S`` later are it and the ranks killed, as Lightning's
    observer would.
    """
    started = list(procs)
    deadline = None
    while deadline is None or time.monotonic() < deadline:
        time.sleep(0.2)
        codes = [proc.poll() for proc in started]
        if all(code == 0 for code in codes):
            return
        for proc, code in zip(started, codes):
            if code not in (None, 0) and proc in procs:
                with suppress(ValueError):  # the list may be emptied at exit meanwhile (see _end_started_ranks)
                    procs.remove(proc)
                deadline = deadline or time.monotonic() + _FAILED_RANK_GRACE_S
    for proc in started:
        with suppress(OSError):
            proc.kill()
    os.kill(launching_pid, signal.SIGKILL)


def end_started_ranks_at_exit(launcher: _Launcher | None) -> bool:
    """If this process started the node's other ranks (popen launcher), end them when it exits, for they must not
    outlive it; whether it did."""
    procs = getattr(launcher, "procs", None)  # the subprocess launcher's, of either Lightning package
    if procs:
        atexit.register(_end_started_ranks, procs)
        return True
    return False


def _end_started_ranks(procs: list[subprocess.Popen]) -> None:
    """At the exit of a launching process whose run failed: end the ranks it started that are still running.

    They wait on this process in a receive, or compute towards one, and would linger until the communication timeout
    (30 minutes by default) or, stuck in user code, forever. At exit, this process's error is already printed;
    a rank that caught the same error and is finishing gets a few seconds, then SIGKILL (a process blocked in a
    receive runs no Python signal handler). The ranks leave the list that Lightning's child-process observer
    watches first, so that it does not answer their end by killing this process. This process's gloo connections
    are closed first: a rank blocked in a wait on it then fails at once and ends with the run's cause, which this
    process recorded (:mod:`~lightning_pipe.reliability.root_cause`), instead of being killed without a word.
    """
    started = list(procs)
    procs.clear()
    if not _process_groups_at_exit["destroy"] and any(proc.poll() is None for proc in started):
        # The run failed: a rank blocked in a wait on this process fails now, and ends with the run's cause.
        close_gloo_groups()
    deadline = time.monotonic() + _STARTED_RANKS_GRACE_S
    for proc in started:
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
