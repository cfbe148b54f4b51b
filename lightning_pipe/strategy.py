"""``GPipeStrategy``: Lightning's bridge to the pipeline, from launch to teardown.

Its hooks follow the order in which Lightning calls them (construction, launch, process groups, model setup, steps,
backward, optimizer step, checkpoints, collectives, teardown), each handing the work on to the object that does it:
the settings, launchers, process groups, this rank's runtime, training step and gradients, the checkpoints.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Generator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import fields, replace
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, TorchCheckpointIO
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import _get_default_process_group_backend_for_device
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.strategy import _ForwardRedirection
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_pipe.checkpoints.pretrained import PretrainedWeights
from lightning_pipe.checkpoints.sharded import SHARDED
from lightning_pipe.checkpoints.strategy_io import StageCheckpoints
from lightning_pipe.partition.counts import PipelineParallelConfig
from lightning_pipe.execution.batchnorm import epoch_last_batch_reached
from lightning_pipe.execution.batchnorm import revert as revert_batch_norms
from lightning_pipe.execution.gradients import StageGradients, stop_agreeing_on_gradient_overflow
from lightning_pipe.execution.materialize import meta_tensors_left_in_place
from lightning_pipe.execution.process_groups import PipelineGroups, broadcast_object, decide_over_world, forget_mesh
from lightning_pipe.execution.process_groups import reduce_tensor, world_barrier
from lightning_pipe.execution.runtime import StageRuntime
from lightning_pipe.execution.steps import TrainingStep
from lightning_pipe.integration.launchers import (
    CheckedMultiProcessingLauncher,
    CheckedSubprocessScriptLauncher,
    SpawnedRanks,
    end_process_groups_at_exit,
    end_started_ranks_at_exit,
    hear_signals,
    keep_process_groups_at_exit,
    requeue_if_due,
    start_process_groups,
)
from lightning_pipe.integration.lightning_packages import LIGHTNING, LightningPackage, adopt_package, register_package
from lightning_pipe.partition.balance import Balance
from lightning_pipe.partition.topology import PipelineLayout
from lightning_pipe.pipeline import BuiltPipeline, announce, build_pipeline, check_partition_before_launch
from lightning_pipe.pipeline import put_whole_model_back, require_automatic_optimization, stage_summary, start_pipeline
from lightning_pipe.pipeline import whole_view as _whole_view
from lightning_pipe.reliability.stall_rule import StartUp
from lightning_pipe.reliability.watchdog import UNWATCHED, StallWatchdog, batch_shape
from lightning_pipe.schedules.actions import PipelineSchedule, StageActions
from lightning_pipe.settings import PipelineSettings, RecomputeMode
from lightning_pipe.trace.stage_summary import StageSummary, stage_devices
from lightning_pipe.trace.tracer import StepObservation, observe_step

# The strategy's arguments that are pipeline settings: PipelineSettings' fields by their public names.
_SETTING_ARGUMENTS = tuple("checkpoint" if f.name == "recompute" else f.name for f in fields(PipelineSettings))

# Lightning's warning for epoch-level values logged without sync_dist=True under a distributed run.
_SYNC_DIST_ADVICE = r"It is recommended to use `self\.log\(.*sync_dist=True\)"


class PipelineView:
    """What a GPipe strategy tells about its pipeline, for users, callbacks and the strategy's own hooks: the counts,
    which rank holds which stage, the process groups, the stage summary and the last observed step. (Not Lightning's:
    :class:`GPipeStrategyMixin` holds Lightning's hooks.)"""

    _settings: PipelineSettings
    _layout: PipelineLayout | None
    _groups: PipelineGroups | None
    _pipeline: BuiltPipeline | None  # built in `setup`, kept after the run for its checkpoints
    _last_observation: StepObservation | None
    num_processes: int
    num_nodes: int
    global_rank: int
    parallel_devices: list[torch.device] | None

    @property
    def config(self) -> PipelineParallelConfig:
        """The resolved stage and micro-batch counts (known once the device count is)."""
        return self._settings.pipeline_config(self.num_processes * self.num_nodes)

    @property
    def chunk_config(self) -> PipelineParallelConfig:
        """The counts the partition splits the blocks by: one part per model chunk (``virtual_stages`` per stage)."""
        return self._settings.chunk_config(self.num_processes * self.num_nodes)

    @property
    def layout(self) -> PipelineLayout:
        """Which rank holds which stage of which replica (``devices * num_nodes = num_stages * replicas``)."""
        if self._layout is None:
            self._layout = self._settings.layout(self.num_processes * self.num_nodes)
        return self._layout

    @property
    def stage_index(self) -> int:
        return self.layout.stage(self.global_rank)

    @property
    def groups(self) -> PipelineGroups:
        """The process groups and this rank's place in them (available once the ranks have started)."""
        assert self._groups is not None, "the process groups exist once the strategy has set up the environment"
        return self._groups

    def stage_summary(self) -> StageSummary:
        """The stage table printed at start-up: where each stage runs, its blocks, parameters, profiled cost and,
        once a training step has run, its measured busy time; with the imbalance (slowest stage over the mean).

        The same on every rank. Available once the Trainer has set the strategy up (from ``on_fit_start`` on).
        """
        if self._pipeline is None:
            raise RuntimeError(
                "the stage summary exists once the strategy has partitioned the model; call stage_summary() after"
                " the Trainer has set up (e.g. in a callback's on_fit_start or after trainer.fit)."
            )
        assert self.parallel_devices is not None
        devices = stage_devices(self.layout.pipeline_ranks(0), self.parallel_devices, self.num_nodes)
        busy = self._last_observation.busy_seconds if self._last_observation is not None else None
        return stage_summary(self._pipeline, devices, busy)

    @property
    def last_observed_step(self) -> StepObservation | None:
        """The bubble and the per-stage busy time of the last logged or traced training step, on every rank."""
        return self._last_observation


class GPipeStrategyMixin(PipelineView):
    """GPipe pipeline parallelism: the model's blocks split into stages, one per process and device::

        Trainer(strategy="gpipe", devices=4)
        Trainer(strategy=GPipeStrategy(num_micro_batches=16, balance="time", schedule="1f1b"), devices=4)

    Every argument but Lightning's own (``accelerator``, ``parallel_devices``, ``cluster_environment``,
    ``checkpoint_io``, ``precision_plugin``, ``process_group_backend``, ``timeout``) is a pipeline setting, documented
    where it is checked: :class:`~lightning_pipe.settings.PipelineSettings` (``checkpoint`` is its ``recompute``),
    and in docs/api.md with the defaults.

    (The implementation, for either Lightning package: :class:`GPipeStrategy` is it with ``lightning.pytorch``'s
    ``ParallelStrategy``, :class:`lightning_pipe.standalone.GPipeStrategy` with ``pytorch_lightning``'s; see
    :mod:`lightning_pipe.integration.lightning_packages`.)
    """

    strategy_name = "gpipe"
    lightning_package: LightningPackage  # what the class's Lightning package gives it

    def __init__(
        self,
        num_stages: int | PipelineParallelConfig | Mapping[str, Any] | None = None,
        num_micro_batches: int | None = None,
        checkpoint: RecomputeMode | None = None,
        balance: Balance = None,
        module_name: str | Sequence[str] | None = None,
        # Lightning's own arguments, as its strategies take them.
        accelerator: Accelerator | None = None, parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None, checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None, process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        # The other pipeline settings (see PipelineSettings).
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen", sample: Any = None,
        trace_steps: Sequence[int] = (), trace_dir: str | Path | None = None, log_bubble_fraction: bool = True,
        deferred_batch_norm: bool = False, mesh_order: Sequence[str] = ("pp", "dp"), tensor_parallel_size: int = 1,
        data_parallel: Literal["replicate", "shard", "full_shard"] = "replicate", tensor_parallel_plan: Any = None,
        save_distributed_checkpoint: bool | None = None, gather_model_after_run: bool = False,
        schedule: str | PipelineSchedule | StageActions = "gpipe", virtual_stages: int | None = None,
        compile: bool | Mapping[str, Any] = False,
        pretrained: str | Path | PretrainedWeights | Mapping[str, Any] | None = None,
        init_module: Callable[[str, nn.Module], None] | None = None,
        stall_watchdog: bool = True, stall_multiple: float = 10.0, stall_floor: float | timedelta = 30.0,
        stall_first_step: float | timedelta | None = None, memory_budget: int | str | None = None,
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        # Every argument but Lightning's own is a pipeline setting, checked here once, before any process starts;
        # what needs the process count or the model is checked at launch (`_configure_launcher`).
        arguments = locals()
        self._settings = PipelineSettings.from_options({name: arguments[name] for name in _SETTING_ARGUMENTS})
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._num_nodes = 1
        self._layout = self._groups = self._pipeline = None  # as PipelineView declares them
        self._runtime = self._training = self._gradients = self._tracer = None  # from `setup` on: the hooks' work
        self._watchdog: StallWatchdog = UNWATCHED
        # What `setup` started or changed in the user's objects: the signals heard, the hooks, the model summary.
        self._undo_at_teardown: list[Callable[[], None]] = []
        self._last_observation: StepObservation | None = None
        self._failed = self._ending_started_ranks = False

    # ---- configuration -------------------------------------------------------------------------------------------

    @property
    @override
    def accelerator(self) -> Accelerator | None:
        return self._accelerator  # type: ignore[attr-defined]

    @accelerator.setter
    def accelerator(self, accelerator: Accelerator | None) -> None:
        # The first thing a Trainer sets: the strategy becomes one of that Trainer's Lightning package.
        if accelerator is not None:
            adopt_package(self, accelerator)
        self._accelerator = accelerator

    @property
    @override
    def is_distributed(self) -> bool:
        # Lightning asks custom strategies this: it enables the distributed sampler and `self.log(sync_dist=True)`.
        # A single pipeline is not data-parallel: every stage reads the batches one device would, in its order.
        return self.layout.num_replicas > 1

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    @override
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    @override
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every stage of a pipeline must see the same batch: shard across replicas only.
        return {"num_replicas": self.layout.num_replicas, "rank": self.layout.replica(self.global_rank)}

    @property
    @override
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    # ---- launch --------------------------------------------------------------------------------------------------

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        self._settings.check_counts(self.num_processes, self.num_nodes)
        settings, processes = self._settings, self.num_processes
        if settings.start_method == "popen":
            self._launcher = self.lightning_package.subprocess_launcher(self.cluster_environment, processes, self.num_nodes)
        else:
            self._launcher = self.lightning_package.multiprocessing_launcher(self, start_method=settings.start_method)
        self._launcher.check_model = partial(
            check_partition_before_launch, settings=settings, num_processes=processes * self.num_nodes
        )

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._setup_distributed()  # as Lightning's DDP strategy: the process groups before anything else
        if self.lightning_module is not None:  # as Lightning's ModelParallelStrategy: for configure_model to split
            self.lightning_module._device_mesh = self._groups.mesh  # type: ignore[union-attr]

    @override
    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # ---- process groups ------------------------------------------------------------------------------------------

    def _setup_distributed(self) -> None:
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        assert self.cluster_environment is not None
        end_process_groups_at_exit(self)
        self._groups = start_process_groups(
            self.cluster_environment, self._settings, self.layout, self.global_rank, self.root_device,
            self._process_group_backend, self._timeout,
        )
        self._watchdog = self._groups.watchdog

    def release_process_groups(self) -> None:
        """Drop every reference to the process groups (at the interpreter's exit, before they are destroyed)."""
        self._watchdog.stop()
        forget_mesh(self.lightning_module, self._groups)  # `self.device_mesh` holds the mesh's groups
        self._groups = self._pipeline = None  # the pipeline's stage and links reach the groups
        self._runtime = self._training = self._gradients = self._tracer = None
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None:
            stop_agreeing_on_gradient_overflow(scaler)

    # ---- model setup ---------------------------------------------------------------------------------------------

    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        stop_signals = hear_signals(
            trainer, self.launcher, self.cluster_environment, self.layout, self.global_rank,
            lambda: self._runtime,
        )
        self._undo_at_teardown = [stop_signals.stop] if stop_signals is not None else []
        if not self.is_distributed:
            # Every stage holds the last stage's logged values: Lightning's advice to synchronise them is moot.
            warnings.filterwarnings("ignore", _SYNC_DIST_ADVICE, self.lightning_package.possible_user_warning)
        module, fitting = self.lightning_module, trainer.state.fn == TrainerFn.FITTING
        if fitting:
            require_automatic_optimization(module)
        started = time.monotonic()  # what the set-up takes bounds the first steps' waits (see StallRule)
        self._pipeline = pipeline = build_pipeline(module, self._settings, self.groups, self.precision_plugin)
        self._runtime, self._training, self._gradients = pipeline.runtime, pipeline.step, pipeline.gradients
        self._tracer, self._settings = pipeline.tracer, pipeline.settings  # settings: with "auto", as chosen
        announce(pipeline, module, self.stage_summary(), self.lightning_package.possible_user_warning)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._undo_at_teardown += start_pipeline(pipeline, module, trainer.callbacks)
        self._setup_optimization(trainer, fitting)
        if fitting:
            self._watchdog.startup_measured(StartUp(time.monotonic() - started, pipeline.compiles))
            self._watchdog.start(Path(trainer.default_root_dir))

    def _setup_optimization(self, trainer: Trainer, fitting: bool) -> None:
        """The optimizers and the precision, with clipping by norm and a gradient scaler's overflow over all stages."""
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)
        precision = self.precision_plugin  # through the strategy: the precision must not hold the groups at exit
        precision.clip_grad_by_norm = lambda *args: self._gradients.clip_grad_by_norm(precision, *args)  # type: ignore
        self._gradients.agree_on_overflow(precision)  # type: ignore[union-attr]

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        # `init_module(empty_init=True)` builds on the meta device: each rank makes only its own stage real in `setup`
        # (see lightning_pipe.execution.materialize). The meta device innermost, or Lightning's device would win.
        with super().tensor_init_context(empty_init), torch.device("meta") if empty_init else nullcontext():
            yield

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        with torch.device("meta"):  # configure_model's modules take no memory until `setup` knows this rank's
            yield

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ---- steps ---------------------------------------------------------------------------------------------------

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        if self._runtime is not None and self.lightning_module is not None:  # for the BatchNorm check of step one
            self._runtime.expect_epoch_last_batch(epoch_last_batch_reached(self.lightning_module.trainer))

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is not None:
            requeue_if_due(trainer, self._runtime)
        self._watchdog.step_starts(trainer.current_epoch if trainer is not None else 0, batch_idx, batch_shape(batch))

    @override
    def on_validation_start(self) -> None:
        self._watchdog.uneven_phase()
        super().on_validation_start()

    @override
    def on_train_end(self) -> None:
        self._watchdog.uneven_phase()
        super().on_train_end()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.lightning_module is not None and self.model is not None and self._training is not None
        return self._training.training_step(self.lightning_module, self.model, self.precision_plugin, args, kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._runtime.step_output(self.lightning_module, "validation_step", args, kwargs)  # type: ignore

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._runtime.step_output(self.lightning_module, "test_step", args, kwargs)  # type: ignore

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._runtime.step_output(self.lightning_module, "predict_step", args, kwargs)  # type: ignore

    # ---- backward and optimizer step -----------------------------------------------------------------------------

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        module, training = self.lightning_module, self._training
        assert module is not None and training is not None
        if training.skipped:
            return closure_loss
        self.pre_backward(closure_loss)
        # Lightning's hooks run around this call in either mode. A per-micro-batch step ran every backward where its
        # schedule said, each micro-batch's loss scaled as the precision scales this one: here on_before_backward
        # comes after the fact, and the scaler only starts its scale on a stage without loss.
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        training.backward(closure_loss, module, self.precision_plugin, optimizer, *args, **kwargs)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        if (seen := observe_step(self._tracer, module.trainer, self._settings.log_bubble_fraction)) is not None:
            self._last_observation = seen  # the stages' timelines gathered: a logged or traced step
        return closure_loss

    @override
    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: LightningModule | nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        def closure_then_reduce_gradients() -> Any:
            result = closure()
            if self._training.skipped:  # type: ignore[union-attr]  # training_step returned None: as one device would
                return None
            self._gradients.reduce(self.lightning_module)  # type: ignore[union-attr, arg-type]
            return result

        result = super().optimizer_step(optimizer, closure_then_reduce_gradients, model, **kwargs)
        self._watchdog.step_ends()
        return result

    # ---- checkpoints (see lightning_pipe.checkpoints.strategy_io) -----------------------------------------------

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # each rank copies its stage's share out of the whole model's checkpoint

    def _checkpoints(self) -> StageCheckpoints:
        pipeline = self._pipeline
        if pipeline is None:
            return StageCheckpoints(self.lightning_module, None, self._groups, self.layout.num_stages)
        return StageCheckpoints(
            self.lightning_module, pipeline.pipelined, self._groups, self.layout.num_stages,
            self._settings.save_distributed_checkpoint, pipeline.deferred, pipeline.pretrained_prefix,
        )

    @override
    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        default_io = type(self.checkpoint_io).load_checkpoint is self.lightning_package.torch_checkpoint_io.load_checkpoint
        with _whole_view(self._pipeline, self.optimizers, as_shards=True):  # DTensors read as they are, each rank its part
            read = self._checkpoints().read(checkpoint_path, self.optimizers, default_io, weights_only)
        return read if read is not None else super().load_checkpoint(checkpoint_path, weights_only=weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        with _whole_view(self._pipeline, as_shards=bool(checkpoint.get(SHARDED))):
            if not self._checkpoints().load_model_state(checkpoint, strict):
                super().load_model_state_dict(checkpoint, strict=strict)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        self._watchdog.checkpoint_phase(self._checkpoints().writes_shards)
        with _whole_view(self._pipeline, as_shards=self._checkpoints().writes_shards):
            return self._checkpoints().module_state()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        self._watchdog.checkpoint_phase(self._checkpoints().writes_shards)
        with _whole_view(self._pipeline, [optimizer], as_shards=self._checkpoints().writes_shards):
            return self._checkpoints().optimizer_state(optimizer)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None
    ) -> None:
        self._watchdog.checkpoint_phase(self._checkpoints().writes_shards)
        spawned = isinstance(self.launcher, SpawnedRanks)
        if not self._checkpoints().write(checkpoint, filepath, storage_options, after_spawned_ranks=spawned):
            super().save_checkpoint(checkpoint, filepath, storage_options)  # rank 0 writes the whole model
        self._watchdog.save_ends()

    def save_pretrained(self, directory: str | Path, prefix: str | None = None, dtype: torch.dtype | str | None = None,
                        max_shard_size: str | int | None = None) -> None:
        """Write the model as a Hugging Face directory that ``from_pretrained`` loads, each stage its own shard (cut at
        ``max_shard_size``); call it on every rank (:meth:`~lightning_pipe.checkpoints.strategy_io.StageCheckpoints.save_pretrained`)."""
        with _whole_view(self._pipeline):  # TP and FSDP hook: split or sharded blocks written whole
            self._checkpoints().save_pretrained(directory, prefix, dtype, max_shard_size)
        self.barrier()  # every rank returns once the directory is complete

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        with _whole_view(self._pipeline, self.optimizers, as_shards=bool(checkpoint.get(SHARDED))):
            if not self._checkpoints().load_optimizer_states(self.optimizers, checkpoint, self.root_device):
                super().load_optimizer_state_dict(checkpoint)

    # ---- collectives ---------------------------------------------------------------------------------------------

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        """Reduce across data-parallel replicas of this stage (logged values are already the same on every stage)."""
        return reduce_tensor(tensor, group if group is not None else self.groups.replicas, reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        return super().all_gather(tensor, group if group is not None else self.groups.replicas, sync_grads)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return decide_over_world(decision, all, self.root_device, self._watchdog)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        world_barrier(self._watchdog)

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return broadcast_object(obj, src, self.global_rank, self._watchdog)

    # ---- teardown ------------------------------------------------------------------------------------------------

    @override
    def on_exception(self, exception: BaseException) -> None:
        # Another stage may be gone: teardown must not wait on it to gather the model.
        self._failed = True
        self._watchdog.uneven_phase()
        keep_process_groups_at_exit()
        if not self._ending_started_ranks:
            self._ending_started_ranks = end_started_ranks_at_exit(self._launcher)

    @override
    def teardown(self) -> None:
        self._watchdog.stop()
        for undo in self._undo_at_teardown:
            undo()
        self._undo_at_teardown = []
        module = self.lightning_module
        if module is not None:
            revert_batch_norms(module)
            if self._pipeline is not None and not self._failed:
                put_whole_model_back(self._pipeline, module, self.optimizers)
        if self._failed and self._pipeline is not None:  # another stage may be gone: no checkpoint can gather them
            self._pipeline = replace(self._pipeline, pipelined=None)
        # Otherwise the pipeline stays: a checkpoint saved after the run gathers every stage's optimizer state.
        with meta_tensors_left_in_place(module):
            super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for name, start_method in (("gpipe", "popen"), ("gpipe_spawn", "spawn"), ("gpipe_fork", "fork")):
            strategy_registry.register(
                name,
                cls,
                description=f"GPipe pipeline parallelism with start_method={start_method!r}",
                start_method=start_method,
            )


class GPipeStrategy(GPipeStrategyMixin, ParallelStrategy):
    __doc__ = GPipeStrategyMixin.__doc__


GPipeStrategy.lightning_package = LightningPackage(
    LIGHTNING, GPipeStrategy, CheckedSubprocessScriptLauncher, CheckedMultiProcessingLauncher, PossibleUserWarning,
    TorchCheckpointIO, _ForwardRedirection,
)
register_package(GPipeStrategy.lightning_package)
