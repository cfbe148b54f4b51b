"""``GPipeStrategy``: Lightning's bridge to the pipeline, from launch to optimizer step.

Sections follow the order in which Lightning calls them: construction, launch, process groups, model setup,
the steps, backward and the optimizer step, checkpoints, collectives, teardown. The work behind them lives in the
modules named for it: :mod:`~lightning_pipe.integration.launchers` (starting and ending the ranks), :mod:`~lightning_pipe.execution.process_groups` (the process groups
and this rank's place), :mod:`~lightning_pipe.execution.runtime` (running a step on this rank's stage),
:mod:`~lightning_pipe.execution.gradients` (reductions, clipping, overflow), :mod:`~lightning_pipe.checkpoints.whole_model` and
:mod:`~lightning_pipe.checkpoints.sharded` (checkpoints, and the trained model after a run), :mod:`~lightning_pipe.trace`
(the bubble and traces). Every setting is checked once, by :class:`~lightning_pipe.settings.PipelineSettings`.
"""

from __future__ import annotations

import signal
import warnings
from collections.abc import Callable, Generator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment, TorchCheckpointIO
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.distributed import (
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.strategies.strategy import _ForwardRedirection
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.optim import Optimizer
from torchmetrics import Metric

from lightning_pipe.checkpoints.export import export_pretrained_by_stage, library_model_prefix
from lightning_pipe.checkpoints.optimizer_states import name_optimizer_state
from lightning_pipe.checkpoints.pretrained import PretrainedLoad, PretrainedWeights, holds_pretrained_weights
from lightning_pipe.checkpoints.sharded import SHARDED, is_sharded_checkpoint
from lightning_pipe.checkpoints.sharded import load as load_sharded
from lightning_pipe.checkpoints.sharded import save as save_sharded
from lightning_pipe.checkpoints.whole_model import (
    PipelinedModule,
    group_names,
    held_state_dict,
    load_stage_optimizer_state,
    load_stage_state_dict,
    refuse_checkpoint_without_stages,
    restore_whole_model,
    whole_optimizer_state,
    whole_state_dict,
)
from lightning_pipe.config import PipelineParallelConfig
from lightning_pipe.execution.batchnorm import defer as defer_batch_norms
from lightning_pipe.execution.batchnorm import epoch_last_batch_size
from lightning_pipe.execution.batchnorm import revert as revert_batch_norms
from lightning_pipe.execution.compiling import check_compiled, compile_stage, uncompiled_name
from lightning_pipe.execution.engine import PipelineEngine
from lightning_pipe.execution.gradients import (
    add_gradients,
    agree_on_gradient_overflow,
    clip_grad_norm_over_pipeline,
    reduce_gradients,
    stop_agreeing_on_gradient_overflow,
    swap_gradients,
)
from lightning_pipe.execution.materialize import global_seed, holds_meta_tensors, materialize
from lightning_pipe.execution.process_groups import PipelineGroups, init_pipeline_groups
from lightning_pipe.execution.random_streams import StageRandomStreams
from lightning_pipe.execution.replayed_logs import StepOutcome
from lightning_pipe.execution.runtime import StageRuntime
from lightning_pipe.execution.stage import StageBlocks
from lightning_pipe.execution.tied import TiedParameters, parameters_shared_across_stages, replicated_parameters
from lightning_pipe.integration.launchers import (
    CheckedMultiProcessingLauncher,
    CheckedSubprocessScriptLauncher,
    SpawnedRanks,
    end_process_groups_at_exit,
    end_started_ranks_at_exit,
    keep_process_groups_at_exit,
    note_sigterm,
)
from lightning_pipe.integration.lightning_packages import (
    LIGHTNING,
    LightningPackage,
    adopt_package,
    overrides,
    register_package,
)
from lightning_pipe.integration.model_summary import summarize_whole_model
from lightning_pipe.partition.balance import (
    Balance,
    PartitionPlan,
    check_one_count_per_stage,
    needs_sample,
    plan_partition,
    profiling_sample,
    recompute_fraction,
    stage_ranges,
)
from lightning_pipe.partition.fingerprint import different_models_message, fingerprint_digest, model_fingerprint
from lightning_pipe.partition.region import (
    MAX_OUTSIDE_SHARE,
    Region,
    find_region,
    outside_parameters,
    outside_share,
    suggested_chain,
)
from lightning_pipe.partition.step_probe import first_training_batch, random_state_kept, training_step_on
from lightning_pipe.partition.topology import PipelineLayout
from lightning_pipe.reliability.stall_rule import Wait
from lightning_pipe.reliability.stop_signals import StopSignals
from lightning_pipe.reliability.watchdog import UNWATCHED, StallWatchdog, batch_shape
from lightning_pipe.schedules.actions import PipelineSchedule, StageActions
from lightning_pipe.schedules.simulator import ideal_bubble
from lightning_pipe.settings import PipelineSettings, RecomputeMode, check_process_count
from lightning_pipe.trace.stage_summary import (
    StageSummary,
    build_stage_summary,
    model_checkpoint_note,
    outside_warning,
    self_checkpointing_warning,
    stage_devices,
)
from lightning_pipe.trace.timeline import StepTimeline
from lightning_pipe.trace.tracer import TRACE_FILE_NAME, PipelineTracer, StepObservation, observe_step

# Lightning's warning for epoch-level values logged without sync_dist=True under a distributed run.
_SYNC_DIST_ADVICE = r"It is recommended to use `self\.log\(.*sync_dist=True\)"

# LightningModule hooks whose user code consumes step results, so they run where those results are: on the last
# stage. Whatever they log is replayed on the other stages.
_EPOCH_END_HOOKS = ("on_train_epoch_end", "on_validation_epoch_end", "on_test_epoch_end")


class GPipeStrategyMixin:
    """GPipe pipeline parallelism: the model's layers split into stages, one per process and device.

    (The implementation, for either Lightning package: :class:`GPipeStrategy` is it with ``lightning.pytorch``'s
    ``ParallelStrategy``, :class:`lightning_pipe.standalone.GPipeStrategy` with ``pytorch_lightning``'s; see
    :mod:`lightning_pipe.integration.lightning_packages`.)

    Args:
        num_stages: pipeline stages; defaults to the number of processes (``devices * num_nodes``). A
            :class:`PipelineParallelConfig`, or a mapping such as a Hydra/OmegaConf node with ``num_stages`` and
            ``num_micro_batches``, may be passed here instead of both counts.
        num_micro_batches: micro-batches per mini-batch; defaults to ``4 * num_stages``, where GPipe's idle bubble
            becomes negligible.
        checkpoint: activation re-computation: ``"always"``, ``"except_last"`` (every forward but those whose
            backward follows next: in GPipe the last micro-batch's) or ``"never"``. By default ``"except_last"``
            under GPipe, ``"never"`` under a per-micro-batch schedule, which holds few micro-batches' activations
            anyway.
        balance: layers per stage, e.g. ``[3, 5]``, or how to choose them: ``"uniform"`` (the default: equal layer
            counts), ``"parameters"`` (equal parameter counts), ``"time"`` (equal forward + backward time, profiled
            per layer on the device) or ``"memory"`` (equal parameter + activation bytes, profiled). The profiled
            modes need a sample input; every rank applies the split that global rank 0 decided.
        module_name: dotted path of the ``nn.Sequential`` to pipeline (``"net.model"``); by default the outermost
            ``nn.Sequential`` with the most parameters.
        start_method: ``"popen"`` (re-run the script per process), ``"spawn"`` or ``"fork"``, as for DDP.
        process_group_backend: ``"gloo"`` or ``"nccl"``; defaults to what the device needs.
        timeout: how long a collective or point-to-point receive may wait before failing.
        sample: an input of the LightningModule's ``forward`` (as ``example_input_array``, which is used when this
            is ``None``) to profile the layers with for ``balance="time"`` or ``"memory"``.
        trace_steps: training steps (``trainer.global_step`` values) whose timeline of every stage is written as a
            Chrome trace to ``trace_dir/gpipe_trace.json``, whose absolute path is printed when it is first written
            (see :mod:`lightning_pipe.trace`).
        trace_dir: where the trace goes; defaults to the Trainer's ``default_root_dir``.
        log_bubble_fraction: send ``pipeline/bubble_fraction`` (the measured idle share of a step's compute window)
            and ``pipeline/ideal_bubble_fraction`` (``(S-1)/(M+S-1)``) to the loggers every ``log_every_n_steps``.
            Costs a few clock readings per micro-batch and one small gather over the pipeline per logged step.
        mesh_order: how ranks are laid out over the pipeline (``"pp"``) and data-parallel (``"dp"``) dimensions,
            outermost first, when ``devices * num_nodes`` is a multiple of ``num_stages`` (the replicas of the
            pipeline average their gradients). ``("pp", "dp")``, as in torchtitan and Megatron, keeps the heavier
            gradient all-reduce on the fast links inside a node and sends only activations across nodes.
        save_distributed_checkpoint: write checkpoints sharded with ``torch.distributed.checkpoint`` (a directory):
            every rank writes its own stage, nothing is gathered on one host. Such a checkpoint resumes with any
            stage count (only the local share is read); ``python -m lightning_pipe.consolidate_checkpoint DIR
            FILE`` turns it into one file that loads anywhere. ``False``: the whole model is gathered to rank 0,
            which writes one file that loads anywhere (with ``load_from_checkpoint``, on one device) and holds the
            whole model and its optimizer state while writing. By default (``None``) sharded for a model built on
            the meta device (in ``configure_model()`` or under ``init_module(empty_init=True)``), one file otherwise.
        gather_model_after_run: after ``fit``, ``validate``, ``test`` or ``predict`` of a model built on the meta
            device, send every stage's layers to global rank 0 (the last stage, the launching process), so that the
            user's model object there holds the whole trained model, as on one device. Costs rank 0 the whole model
            in host memory. By default each rank keeps only its own stage (the other layers stay on the meta
            device) and the trained model lives in the checkpoints. A model built the usual way always comes back
            whole on every rank.
        schedule: the order of each stage's forwards, backwards, sends and receives in a step (see
            docs/schedules.md): ``"gpipe"`` (the default; the loss on the whole batch), or a schedule with a loss per
            micro-batch, for which ``training_step`` runs once per micro-batch: ``"1f1b"`` (at most ``S - stage``
            micro-batches' activations held), ``"interleaved_1f1b"`` (``virtual_stages`` model chunks per stage: a
            smaller bubble), ``"zero_bubble"`` (backward split into input and weight gradients, the latter filling the
            bubble) or ``"zbv"`` (two chunks per stage in a V). Or a function ``(stage, num_stages,
            num_micro_batches, virtual_stages) -> list[Action]`` (see :mod:`lightning_pipe.schedules`).
        virtual_stages: model chunks per stage for the schedules that interleave them (``"interleaved_1f1b"``:
            2 by default; ``"zbv"``: 2); the pipelined blocks are split into ``num_stages * virtual_stages`` chunks.
        deferred_batch_norm: update BatchNorm running statistics once per mini-batch, from the whole mini-batch's
            statistics, so that they equal one device's. By default (GPipe's semantics) each micro-batch updates
            them with its own statistics. Either way each micro-batch is normalised by its own statistics.
        compile: compile each stage's layers with ``torch.compile`` (``True``), or with these keyword arguments of
            ``torch.compile`` (``{"mode": "max-autotune"}``): every layer separately, as torchtitan compiles each
            block. A ``torch.compile`` wrapper around the pipelined module is honoured the same way, with its settings
            (see :mod:`lightning_pipe.execution.compiling`).
        pretrained: start from stored weights, each rank reading only its stage's and the replicated modules'
            tensors: the path of a Hugging Face model directory (safetensors, single or sharded, or
            ``pytorch_model.bin``), of a weights file, or of a checkpoint of this package; or
            :class:`~lightning_pipe.PretrainedWeights` with the ``prefix`` where the stored model sits in the
            LightningModule (inferred by default) and the ``dtype`` (the precision's, or the stored one). Checked
            against the whole model on every rank before the first step (see :mod:`lightning_pipe.checkpoints.pretrained`); a
            model object loads them once (a later ``trainer.test`` keeps what ``fit`` trained).
        stall_watchdog: end the run on every rank when, in a training step, a wait on another rank (activations,
            gradients, the step's results, the gradient reductions and barriers) lasts longer than
            ``max(stall_floor, stall_multiple * the slowest recent step)``, or ``stall_first_step`` in a first step,
            naming the rank that stopped and writing every rank's Python stack to ``default_root_dir/stall_stacks/``
            (see :mod:`lightning_pipe.reliability.watchdog`). Validation, checkpoints and epoch ends are left to ``timeout``,
            which stays the hard limit everywhere.
        stall_multiple: how many times the slowest of the last 100 regular training steps a wait may last.
        stall_floor: the shortest bound, in seconds or as a ``timedelta``.
        stall_first_step: the bound on a wait in a first step (a run's first two, an epoch's first, the first after
            validation or a checkpoint, the first with a batch of new shapes), which may compile or allocate for
            long: seconds or a ``timedelta``. Where the regular bound is longer, that one.
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
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        sample: Any = None,
        trace_steps: Sequence[int] = (),
        trace_dir: str | Path | None = None,
        log_bubble_fraction: bool = True,
        deferred_batch_norm: bool = False,
        mesh_order: tuple[str, str] = ("pp", "dp"),
        save_distributed_checkpoint: bool | None = None,
        gather_model_after_run: bool = False,
        schedule: str | PipelineSchedule | StageActions = "gpipe",
        virtual_stages: int | None = None,
        compile: bool | Mapping[str, Any] = False,
        pretrained: str | Path | PretrainedWeights | Mapping[str, Any] | None = None,
        stall_watchdog: bool = True,
        stall_multiple: float = 10.0,
        stall_floor: float | timedelta = 30.0,
        stall_first_step: float | timedelta = 600.0,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        # Every setting is checked here, before any process starts; what needs the process count or the model is
        # checked at launch (`_configure_launcher`, `_check_partition`).
        self._settings = PipelineSettings(
            num_stages,  # type: ignore[arg-type]  (a PipelineParallelConfig or a mapping holds both counts)
            num_micro_batches,
            recompute=checkpoint,
            balance=balance,  # type: ignore[arg-type]
            module_name=module_name,
            sample=sample,
            trace_steps=trace_steps,  # type: ignore[arg-type]
            trace_dir=trace_dir,  # type: ignore[arg-type]
            log_bubble_fraction=log_bubble_fraction,
            deferred_batch_norm=deferred_batch_norm,
            mesh_order=mesh_order,
            start_method=start_method,
            save_distributed_checkpoint=save_distributed_checkpoint,
            gather_model_after_run=gather_model_after_run,
            schedule=schedule,
            virtual_stages=virtual_stages,
            compile=compile,
            pretrained=pretrained,  # type: ignore[arg-type]  (a path or mapping becomes PretrainedWeights)
            stall_watchdog=stall_watchdog,
            stall_multiple=stall_multiple,
            stall_floor=stall_floor,  # type: ignore[arg-type]  (a timedelta is converted to seconds)
            stall_first_step=stall_first_step,  # type: ignore[arg-type]  (likewise)
        )
        # The settings the process-group, setup, step and checkpoint sections read.
        self._module_name = self._settings.module_name
        self._deferred_batch_norm = self._settings.deferred_batch_norm
        self._log_bubble_fraction = self._settings.log_bubble_fraction
        self._trace_steps = self._settings.trace_steps
        self._mesh_order = self._settings.mesh_order
        self._save_distributed_checkpoint = self._settings.save_distributed_checkpoint
        self._virtual_stages = self._settings.virtual_stages
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._num_nodes = 1
        self._layout: PipelineLayout | None = None
        self._groups: PipelineGroups | None = None
        self._runtime: StageRuntime | None = None
        self._replicated: list[nn.Parameter] = []
        self._wrapped_hooks: list[str] = []
        self._undo_summaries: Callable[[], None] | None = None  # puts Lightning's model summary callbacks back
        self._plan: PartitionPlan | None = None
        self._plan_module_name = ""
        self._outside: list[tuple[str, int]] = []  # what runs whole on every stage, with its parameter count
        self._tracer: PipelineTracer | None = None
        self._last_observation: StepObservation | None = None
        self._pipelined: PipelinedModule | None = None
        self._failed = False
        self._ending_started_ranks = False
        self._gather_model_after_run = self._settings.gather_model_after_run
        self._deferred = False  # the pipelined module was built on the meta device (see `model_sharded_context`)
        self._watchdog: StallWatchdog = UNWATCHED
        self._stop_signals: StopSignals | None = None  # hears SIGTERM and SIGINT while the main thread waits
        self._tied: TiedParameters | None = None  # parameters shared by layers of several stages
        # A per-micro-batch step's gradients, from its `training_step` to Lightning's `backward` (see `swap_gradients`).
        self._step_gradients: tuple[list[nn.Parameter], list[Tensor | None]] = ([], [])
        self._pretrained_prefix: str | None = None  # where the pretrained model sits, once its weights were mapped

    # ---- configuration -------------------------------------------------------------------------------------------

    @property
    def accelerator(self) -> Accelerator | None:
        return self._accelerator  # type: ignore[attr-defined]

    @accelerator.setter
    def accelerator(self, accelerator: Accelerator | None) -> None:
        # The first thing a Trainer sets: the strategy becomes one of that Trainer's Lightning package.
        if accelerator is not None:
            adopt_package(self, accelerator)
        self._accelerator = accelerator

    @property
    def config(self) -> PipelineParallelConfig:
        """The resolved stage and micro-batch counts (known once the device count is)."""
        return self._settings.pipeline_config(self.num_processes * self.num_nodes)

    @property
    def chunk_config(self) -> PipelineParallelConfig:
        """The counts the partition splits the blocks by: one part per model chunk (``virtual_stages`` per stage)."""
        config = self.config
        return PipelineParallelConfig(config.num_stages * self._virtual_stages, config.num_micro_batches)

    @property
    def layout(self) -> PipelineLayout:
        """Which rank holds which stage of which replica (``devices * num_nodes = num_stages * replicas``)."""
        if self._layout is None:
            num_stages = self.config.num_stages
            replicas = max(1, self.num_processes * self.num_nodes // num_stages)
            self._layout = PipelineLayout(
                num_stages, replicas, pipeline_outermost=self._mesh_order[0] == "pp",
                loss_on_first_stage=num_stages > 1 and self._settings.schedule.loss_stage(num_stages, self._virtual_stages) == 0,
            )
        return self._layout

    @property
    def is_distributed(self) -> bool:
        # Lightning asks custom strategies this: it enables the distributed sampler and `self.log(sync_dist=True)`.
        # A single pipeline is not data-parallel: every stage reads the batches one device would, in its order.
        return self.layout.num_replicas > 1

    @property
    def stage_index(self) -> int:
        return self.layout.stage(self.global_rank)

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every stage of a pipeline must see the same batch: shard across replicas only.
        return {"num_replicas": self.layout.num_replicas, "rank": self.layout.replica(self.global_rank)}

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    # ---- launch --------------------------------------------------------------------------------------------------

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        settings = self._settings
        if settings.num_stages is not None:
            check_process_count(settings.num_stages, self.num_processes, self.num_nodes)
        elif isinstance(settings.balance, list):  # with num_stages set, `PipelineSettings` compared the two
            check_one_count_per_stage(settings.balance, self.config.num_stages, virtual_stages=self._virtual_stages,
                                      schedule=settings.schedule.name)
        self.config  # noqa: B018  (validates the resolved counts before any process starts)
        if settings.num_stages is None:  # with num_stages set, `PipelineSettings` ran the user's schedule already
            settings.check_schedule(self.config)
        if settings.start_method == "popen":
            self._launcher = self.lightning_package.subprocess_launcher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )
        else:
            self._launcher = self.lightning_package.multiprocessing_launcher(self, start_method=settings.start_method)
        self._launcher.check_model = self._check_partition

    def _check_partition(self, model: LightningModule, trainer: Trainer | None = None) -> None:
        """Raise the partition's errors (no Sequential, too many stages, a bad balance) before processes start."""
        if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
            _require_automatic_optimization(model)
        if overrides(model, "configure_model"):
            return  # the layers may exist only once configure_model has run, in each process: `setup` checks them
        settings = self._settings
        region = self._find_region(model, trainer)
        check_compiled(model, region)
        stage_ranges(self.chunk_config, len(region), settings.balance if isinstance(settings.balance, list) else None)
        profiling_sample(settings.balance, settings.sample, model)

    def setup_environment(self) -> None:
        super().setup_environment()
        self._setup_distributed()

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
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(
            self.cluster_environment, self._process_group_backend, timeout=self._timeout, device_id=device_id
        )
        end_process_groups_at_exit(self)
        rule, layout = self._settings.stall_rule, self.layout
        if rule is not None and self.world_size > 1:
            names = {rank: f"stage {layout.stage(rank)} (rank {rank})" for rank in range(self.world_size)}
            self._watchdog = StallWatchdog(rule, self.global_rank, names, self._timeout)
        self._groups = init_pipeline_groups(
            layout, self.global_rank, self.root_device, self._process_group_backend, self._timeout,
            self._mesh_order, self._watchdog,
        )

    def release_process_groups(self) -> None:
        """Drop every reference to the process groups (at the interpreter's exit, before they are destroyed)."""
        self._watchdog.stop()
        self._groups = self._runtime = self._tracer = self._tied = None
        self._pipelined = None  # its way to put the blocks back holds the stage, whose callbacks reach the links
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None:
            stop_agreeing_on_gradient_overflow(scaler)

    @property
    def groups(self) -> PipelineGroups:
        """The process groups and this rank's place in them (available once the ranks have started)."""
        assert self._groups is not None, "the process groups exist once the strategy has set up the environment"
        return self._groups

    # ---- model setup ---------------------------------------------------------------------------------------------

    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        # The Trainer registers its SIGTERM handler right after this; see `note_sigterm`.
        connector = trainer._signal_connector
        connector._sigterm_notifier_fn = partial(  # type: ignore[method-assign]
            note_sigterm, trainer, self.launcher, self.cluster_environment, self.global_rank
        )
        if self.world_size > 1:  # a rank blocked in a wait on a peer still stops (see lightning_pipe.reliability.stop_signals)
            self._stop_signals = StopSignals(
                f"stage {self.layout.stage(self.global_rank)} (rank {self.global_rank})",
                lambda: list(getattr(self.launcher, "procs", None) or []),
            )
            self._stop_signals.start()
        if self.layout.num_stages > 1:  # SLURM's requeue waits for a step boundary (see `_note_requeue`)
            connector._slurm_sigusr_handler_fn = self._note_requeue  # type: ignore[method-assign]
        if not self.is_distributed:
            # Every stage holds the last stage's logged values: Lightning's advice to synchronise them is moot.
            warnings.filterwarnings("ignore", _SYNC_DIST_ADVICE, self.lightning_package.possible_user_warning)
        module = self.lightning_module
        if trainer.state.fn == TrainerFn.FITTING:
            _require_automatic_optimization(module)
        self._partition(module)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self._broadcast_replicated_state()
        self._sync_metrics_within_replicas(module)
        self._wrap_epoch_end_hooks(module)
        assert self._pipelined is not None
        self._undo_summaries = summarize_whole_model(trainer.callbacks, self._runtime.stage, self._pipelined.ranges)
        self._runtime.share_outcome(module, StepOutcome())  # every stage starts from the last stage's random state
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        # Clipping by norm must see the norm over all stages, not this stage's share of it.
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_global_norm  # type: ignore[method-assign]
        # With a gradient scaler (16-mixed), an overflow on one stage must skip the step on every stage.
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None and self.layout.num_stages > 1:
            agree_on_gradient_overflow(scaler, self.groups.pipeline, self.root_device, self._watchdog)
        if trainer.state.fn == TrainerFn.FITTING:
            self._watchdog.start(Path(trainer.default_root_dir))

    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``trainer.init_module(empty_init=True)`` builds the model on the meta device: every rank then allocates
        and initialises only its own stage in ``setup`` (see :mod:`lightning_pipe.execution.materialize`)."""
        # The meta device innermost: Lightning's context sets the stage's device, which would otherwise win.
        with super().tensor_init_context(empty_init), torch.device("meta") if empty_init else nullcontext():
            yield

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model()`` runs here: its layers are built on the meta device, taking no memory until ``setup``
        knows which of them are this rank's."""
        with torch.device("meta"):
            yield

    def _partition(self, module: LightningModule) -> None:
        """Replace the pipelined ``nn.Sequential`` by this rank's :class:`StageLayers` and build its runtime."""
        config, schedule, v = self.config, self._settings.schedule, self._virtual_stages
        self._check_every_rank_built_the_same_model(module)
        region = self.broadcast(self._find_region(module, module._trainer))  # every rank splits the same blocks
        check_compiled(module, region)
        blocks = region.blocks(module)
        layers = nn.Sequential(*blocks)  # the blocks in order, for the partition plan and the whole model
        self._plan, self._plan_module_name = self._decide_partition(module, layers), region.label
        self._outside = outside_parameters(module, region)
        chunk_ranges = self._plan.ranges  # one per model chunk: num_stages * virtual_stages
        held = [
            sorted(i for k in schedule.chunks(s, config.num_stages, v) for i in chunk_ranges[k])
            for s in range(config.num_stages)
        ]
        ties = parameters_shared_across_stages(blocks, held)  # before materialising replaces parameters
        whole_model_state = list(module.state_dict().keys())
        whole_model_parameters = [parameter_name for parameter_name, _ in module.named_parameters()]
        pretrained = self._plan_pretrained_load(module)  # checked on the whole model: every rank fails alike
        index = self.stage_index
        local = {k: chunk_ranges[k] for k in schedule.chunks(index, config.num_stages, v)}
        stage = StageBlocks(module, region, local, index, config.num_stages, num_chunks=len(chunk_ranges))
        stage.install()
        # Built on the meta device: only what this rank runs becomes real (the stage, the replicated modules).
        self._deferred = self.reduce_boolean_decision(holds_meta_tensors(layers), all=False)
        filled = pretrained.mapping.filled if pretrained is not None else ()
        materialize(module, self.root_device, self.broadcast(global_seed()), filled)
        if pretrained is not None:
            with self.precision_plugin.tensor_init_context():  # sets the precision's dtype as torch's default
                precision_dtype = torch.get_default_dtype()
            pretrained.fill(module, precision_dtype)
        if self._deferred_batch_norm:
            for block in stage.blocks:
                defer_batch_norms(block)
        self._pipelined = PipelinedModule(
            region.label, layers, held, whole_model_state, whole_model_parameters, put_back=stage.uninstall,
            block_names=region.names,
        )
        self._replicated = replicated_parameters(module, region.names)
        self._tied = TiedParameters(ties, stage, self.layout, self._replicated, self._timeout)
        compile_stage(module, region, stage, self._settings.compile_options)
        summary = self.stage_summary()
        rank_zero_info(str(summary))
        if (warning := outside_warning(summary, suggested_chain(module, region))) is not None:
            rank_zero_warn(warning, category=self.lightning_package.possible_user_warning)
        checkpointing_themselves = any(getattr(m, "gradient_checkpointing", None) is True for m in stage.modules())
        if checkpointing_themselves and self._settings.recompute != "never":
            warning = self_checkpointing_warning(self._settings.recompute)
            rank_zero_warn(warning, category=self.lightning_package.possible_user_warning)
        groups = self.groups
        timeline = StepTimeline(self.root_device, enabled=self._log_bubble_fraction or bool(self._trace_steps))
        # One stage draws from the global stream, as one device does; several need streams of their own.
        streams = StageRandomStreams(self.root_device, index, groups.replica) if config.num_stages > 1 else None
        engine = PipelineEngine(
            stage, config.num_micro_batches, self._settings.recompute,
            links={peer: groups.link(peer) for peer in schedule.neighbours(index, config.num_stages, v)},
            schedule=schedule,
            virtual_stages=v,
            timeline=timeline,
            random_streams=streams,
        )
        self._runtime = StageRuntime(
            groups, engine, stage, scale_loss=self._scale_micro_batch_loss, step_context=self.precision_plugin.train_step_context,
            on_model_checkpoint=partial(rank_zero_info, model_checkpoint_note(self._settings.recompute)),
        )
        self._tracer = None
        if timeline.enabled and config.num_stages > 1:
            trace_dir = self._settings.trace_dir or Path(module.trainer.default_root_dir)
            self._tracer = PipelineTracer(
                timeline, groups.meta, index, config.num_stages, self.global_rank, self._settings.trace_steps,
                trace_path=trace_dir / TRACE_FILE_NAME if self.global_rank == 0 else None,
                ideal_bubble=partial(ideal_bubble, schedule, config.num_stages, virtual_stages=v),
            )

    def _plan_pretrained_load(self, module: LightningModule) -> PretrainedLoad | None:
        """The pretrained weights to read into this model, checked against it; None when none were asked for or
        this model object holds them already (from an earlier run, which may have trained them)."""
        weights = self._settings.pretrained
        if weights is None:
            return None
        if holds_pretrained_weights(module):
            rank_zero_info(f"The model holds the weights of an earlier run: {str(weights.path)!r} is not read again.")
            return None
        load = PretrainedLoad.plan(module, weights)
        self._pretrained_prefix = load.mapping.prefix
        rank_zero_info(
            f"Starting from the pretrained weights {load.stored.describe()}: {load.mapping.describe(load.stored)};"
            " each rank reads its stage's share."
        )
        return load

    def _check_every_rank_built_the_same_model(self, module: LightningModule) -> None:
        """Raise on every rank if the ranks' models differ in any state-dict entry's name, shape or dtype."""
        if self.world_size == 1:
            return
        fingerprint = model_fingerprint(module)
        digests: list[Any] = [None] * self.world_size
        dist.all_gather_object(digests, fingerprint_digest(fingerprint))
        if len(set(digests)) == 1:
            return
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, fingerprint)
        describe = lambda rank: f"rank {rank} (stage {self.layout.stage(rank)})"  # noqa: E731
        raise ValueError(different_models_message(every, describe))

    def _find_region(self, module: LightningModule, trainer: Trainer | None = None) -> Region:
        """The blocks to pipeline (see :func:`find_region`); with the ``trainer`` of a fit, also those that the
        training step chains, when what the model and its ``forward`` show leaves much of the model outside."""
        sample = self._settings.sample if self._settings.sample is not None else getattr(module, "example_input_array", None)
        name, num_stages = uncompiled_name(module, self._settings.module_name), self.config.num_stages
        region = find_region(module, name, sample, num_stages=num_stages)
        fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
        if name is None and fitting and outside_share(module, region) > MAX_OUTSIDE_SHARE:
            with random_state_kept():
                batch = first_training_batch(trainer, module)
                if batch is not None:
                    region = find_region(module, name, sample, training_step_on(batch), num_stages)
        return region

    def _decide_partition(self, module: LightningModule, sequential: nn.Sequential) -> PartitionPlan:
        """The split, decided on global rank 0 (profiling there when ``balance`` asks) and broadcast, so that every
        rank applies the same split even where measurements differ between ranks."""
        settings, config = self._settings, self.chunk_config
        decided: PartitionPlan | str | None = None
        error: Exception | None = None
        if self.global_rank == 0:
            fraction = recompute_fraction(settings.recompute, config.num_micro_batches)
            try:
                if needs_sample(settings.balance) and holds_meta_tensors(sequential):
                    raise ValueError(
                        f"balance={settings.balance!r} profiles every layer with its weights, but the pipelined module"
                        " was built on the meta device (in configure_model() or under init_module(empty_init=True)),"
                        " where it has none yet; use balance='parameters' or a list of layers per stage, or build"
                        " the model in __init__."
                    )
                decided = plan_partition(
                    module, sequential, config, settings.balance, settings.sample, self.root_device, fraction
                )
            except Exception as exception:  # the other ranks wait in the broadcast: tell them, then raise
                error, decided = exception, f"{type(exception).__name__}: {exception}"
        decided = self.broadcast(decided, src=0)
        if error is not None:
            raise error
        if isinstance(decided, str):
            raise RuntimeError(f"global rank 0 failed to partition the model: {decided}")
        assert decided is not None
        return decided

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def _broadcast_replicated_state(self) -> None:
        """Start identical where training keeps things identical: parameters outside the pipelined module on every
        rank (from rank 0), and each stage's parameters and buffers on its replicas (from replica 0)."""
        assert self._runtime is not None
        with torch.no_grad():
            for tensor in self._replicated:
                dist.broadcast(tensor.data, src=0)
            assert self._tied is not None
            self._tied.start_identical()
            if self.layout.num_replicas > 1:
                source = self.layout.rank(self.stage_index, replica=0)
                for tensor in [*self._runtime.stage.parameters(), *self._runtime.stage.buffers()]:
                    dist.broadcast(tensor.data, src=source, group=self.groups.replicas)

    def _sync_metrics_within_replicas(self, module: LightningModule) -> None:
        """torchmetrics syncs over the whole world by default; only a stage's replicas hold the same metric."""
        for metric in module.modules():
            if isinstance(metric, Metric):
                metric.process_group = self.groups.replicas

    def _wrap_epoch_end_hooks(self, module: LightningModule) -> None:
        """Run the user's epoch-end hooks on the last stage only, replaying what they log on the other stages."""
        for hook in _EPOCH_END_HOOKS:
            if hook in module.__dict__:
                continue  # already wrapped by an earlier call with this model
            user_hook = getattr(module, hook)

            def wrapped(user_hook: Callable[[], None] = user_hook) -> None:
                assert self._runtime is not None
                self._watchdog.uneven_phase()  # the last stage may take long over a whole epoch's results
                self._runtime.run_on_last_stage(module, user_hook)

            setattr(module, hook, wrapped)
            self._wrapped_hooks.append(hook)

    # ---- what the pipeline reports -------------------------------------------------------------------------------

    def stage_summary(self) -> StageSummary:
        """The stage table printed at start-up: where each stage runs, its layers, parameters, profiled cost and,
        once a training step has run, its measured busy time; with the imbalance (slowest stage over the mean).

        The same on every rank. Available once the Trainer has set the strategy up (from ``on_fit_start`` on).
        """
        if self._plan is None:
            raise RuntimeError(
                "the stage summary exists once the strategy has partitioned the model; call stage_summary() after"
                " the Trainer has set up (e.g. in a callback's on_fit_start or after trainer.fit)."
            )
        ranks = self.layout.pipeline_ranks(0)
        schedule, num_stages = self._settings.schedule, self.layout.num_stages
        assert self.parallel_devices is not None
        devices = stage_devices(ranks, self.parallel_devices, self.num_nodes)
        busy = self._last_observation.busy_seconds if self._last_observation is not None else None
        return build_stage_summary(
            self._plan,
            self._plan_module_name,
            ranks,
            devices,
            sum(p.numel() for p in self._replicated),
            self.config.num_micro_batches,
            self._settings.recompute,
            busy,
            built_whole=not self._deferred,
            outside=self._outside,
            owners=[schedule.owner(k, num_stages) for k in range(len(self._plan.ranges))],
            schedule=schedule.name,
            ideal_bubble=ideal_bubble(schedule, num_stages, self.config.num_micro_batches, self._virtual_stages),
        )

    def _observe_step(self) -> None:
        """After a training step's backward: gather the stages' timelines when this step is logged (every
        ``log_every_n_steps``, as Lightning's own monitors do) or traced; log the bubble, write the trace."""
        module = self.lightning_module
        if self._tracer is None or module is None:
            return
        observation = observe_step(self._tracer, module.trainer, self._log_bubble_fraction)
        if observation is not None:
            self._last_observation = observation

    @property
    def last_observed_step(self) -> StepObservation | None:
        """The bubble and the per-stage busy time of the last logged or traced training step, on every rank."""
        return self._last_observation

    # ---- steps ---------------------------------------------------------------------------------------------------

    def on_train_start(self) -> None:
        super().on_train_start()
        if self._runtime is not None and self.lightning_module is not None:  # for the BatchNorm check of step one
            self._runtime.epoch_last_batch = _epoch_last_batch_reached(self.lightning_module.trainer)

    def _note_requeue(self, signum: Any, frame: Any) -> None:
        """SLURM's requeue signal (SIGUSR1). Lightning saves the hpc checkpoint and requeues from inside the handler,
        wherever each rank happens to be: mid-step, a rank's peers wait on it while it waits for them in the
        checkpoint's gathers. Counted instead: the last stage's count travels with its next step outcome, and every
        stage of the pipeline requeues (Lightning's handler) at the start of the training step after it."""
        if self._runtime is not None:
            self._runtime.requeues_asked += 1

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        epoch = trainer.current_epoch if trainer is not None else 0
        if trainer is not None and self._runtime is not None and self._runtime.requeue_due:
            self._runtime.requeue_due = False
            connector = trainer._signal_connector
            type(connector)._slurm_sigusr_handler_fn(connector, signal.SIGUSR1, None)  # type: ignore[arg-type]
        self._watchdog.step_starts(epoch, batch_idx, batch_shape(batch))

    def on_validation_start(self) -> None:
        self._watchdog.uneven_phase()
        super().on_validation_start()

    def on_train_end(self) -> None:
        self._watchdog.uneven_phase()
        super().on_train_end()

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self._runtime is not None
        # A per-micro-batch step enters the precision's context around each call of the user's step, not around the
        # backwards it runs in between.
        if self._runtime.per_micro_batch:  # its backwards run inside: see `swap_gradients`
            trainable = [p for p in self.model.parameters() if p.requires_grad]
            earlier = swap_gradients(trainable, [None] * len(trainable))
            outcome, output = self._run_step("training_step", args, kwargs)
            self._step_gradients = (trainable, swap_gradients(trainable, earlier))
        else:
            with self.precision_plugin.train_step_context():
                outcome, output = self._run_step("training_step", args, kwargs)
        if outcome.skipped:
            # Lightning refuses `None` from a distributed training_step. A placeholder loss that `backward` ignores,
            # and that the optimizer-step closure reports as None, gives one device's behaviour: no update.
            return torch.zeros((), device=self.root_device)
        if self._holds_step_output:
            return output
        # Lightning calls backward on this; the pipeline's own backward runs instead (see `backward`).
        return torch.tensor(outcome.loss, device=self.root_device)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            _, output = self._run_step("validation_step", args, kwargs)
        return output if self._holds_step_output else None

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            _, output = self._run_step("test_step", args, kwargs)
        return output if self._holds_step_output else None

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            _, output = self._run_step("predict_step", args, kwargs)
        return output if self._holds_step_output else None

    def _run_step(self, hook: str, args: tuple, kwargs: dict) -> tuple[StepOutcome, Any]:
        assert self._runtime is not None and self.lightning_module is not None
        return self._runtime.run_step(self.lightning_module, hook, args, kwargs)

    @property
    def _holds_step_output(self) -> bool:
        assert self._runtime is not None
        return self._runtime.is_last

    # ---- backward and optimizer step -----------------------------------------------------------------------------

    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        runtime, module = self._runtime, self.lightning_module
        assert runtime is not None and module is not None
        if runtime.step_skipped:
            return closure_loss
        self.pre_backward(closure_loss)
        # Lightning's hooks run around this call in either mode. A per-micro-batch step ran every backward where its
        # schedule said, each micro-batch's loss scaled as the precision scales this one (`_scale_micro_batch_loss`):
        # here on_before_backward comes after the fact, and the scaler only starts its scale on a stage without loss.
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        if runtime.per_micro_batch:
            add_gradients(*self._step_gradients)
            self._step_gradients = ([], [])
        else:
            if runtime.is_last:  # the user's loss.backward(), through the model's head to the blocks' output
                self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
            runtime.backward()  # the blocks' own backward, micro-batch by micro-batch
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        self._observe_step()
        return closure_loss

    def _scale_micro_batch_loss(self, loss: Tensor) -> Tensor:
        """What a per-micro-batch step back-propagates of a micro-batch's (weighted) loss: divided over Lightning's
        gradient accumulation, and scaled by the gradient scaler, as Lightning does with one step's loss."""
        module = self.lightning_module
        assert module is not None
        loss = loss / module.trainer.accumulate_grad_batches
        scaler = getattr(self.precision_plugin, "scaler", None)
        return scaler.scale(loss) if scaler is not None else loss

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: LightningModule | nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        def closure_then_reduce_gradients() -> Any:
            result = closure()
            if self._runtime is not None and self._runtime.step_skipped:  # training_step returned None: tell the precision plugin, as one device would
                return None
            self._reduce_gradients()
            return result

        result = super().optimizer_step(optimizer, closure_then_reduce_gradients, model, **kwargs)
        self._watchdog.step_ends()
        return result

    def _reduce_gradients(self) -> None:
        """Sum the replicated parameters' gradients over the pipeline, then average every gradient over replicas."""
        reduce_gradients(self._replicated, self.groups.pipeline, average=False, watchdog=self._watchdog)
        assert self._tied is not None
        self._tied.sum_gradients()
        if self.layout.num_replicas > 1:
            assert self.lightning_module is not None
            trainable = [p for p in self.lightning_module.parameters() if p.requires_grad]
            reduce_gradients(trainable, self.groups.replicas, average=True, watchdog=self._watchdog)

    def _clip_grad_by_global_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        """``clip_grad_norm_`` over the whole model (see :func:`clip_grad_norm_over_pipeline`)."""
        params = self.precision_plugin.main_params(optimizer)
        assert self._tied is not None
        clip_grad_norm_over_pipeline(
            params, self._replicated, clip_val, self.groups.pipeline, self.root_device, self._tied.counted_elsewhere,
            self._watchdog,
        )

    # ---- checkpoints ---------------------------------------------------------------------------------------------
    # A checkpoint holds the whole model, numbered as on one device, so it loads anywhere. It is loaded after `setup`
    # has split the model, memory-mapped: each rank copies out only its stage's weights and optimizer state, and
    # the rest of the file is never read into its memory. A model built on the meta device is saved sharded by
    # default: each rank writes its own stage. After a run the split is remembered (`_pipelined`), so that a
    # checkpoint saved then still holds every stage's optimizer state.

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    def load_checkpoint(self, checkpoint_path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
        """A local checkpoint file memory-mapped (``torch.load(mmap=True)``), not read: its tensors take memory only
        where a rank copies them out. Other checkpoint IO (remote paths, custom plugins) goes through Lightning's."""
        if is_sharded_checkpoint(checkpoint_path):
            assert self.lightning_module is not None
            names = [group_names(self.lightning_module, optimizer) for optimizer in self.optimizers]
            return load_sharded(checkpoint_path, set(self.lightning_module.state_dict()), names, weights_only)
        local_file = "://" not in str(checkpoint_path) and Path(checkpoint_path).is_file()
        default_io = type(self.checkpoint_io).load_checkpoint is self.lightning_package.torch_checkpoint_io.load_checkpoint
        if not (local_file and default_io and self.layout.num_stages > 1):
            return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        return torch.load(checkpoint_path, map_location="cpu", mmap=True, weights_only=weights_only)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Copy this rank's weights (its stage's and the replicated modules') out of the whole model's state dict."""
        module = self.lightning_module
        assert module is not None
        if self._pipelined is None or checkpoint.get(SHARDED):
            return super().load_model_state_dict(checkpoint, strict=strict)  # a whole model, or this rank's share
        load_stage_state_dict(module, checkpoint["state_dict"], self._pipelined.state_keys, strict)

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The whole model's state dict on the rank that writes checkpoints (global rank 0); a share elsewhere."""
        self._watchdog.uneven_phase()  # a checkpoint: gathered here, written by rank 0 while the others wait
        module = self.lightning_module
        assert module is not None
        if self._pipelined is None or self.layout.num_stages == 1:
            return module.state_dict()
        if self._saves_sharded:  # written by `save_checkpoint`: this rank's own weights
            return held_state_dict(module)
        return whole_state_dict(module, self._pipelined, self.groups.stage_ranks, self.global_rank, self.groups.meta)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The whole model's optimizer state on the checkpoint writer, numbered as a single-device optimizer's."""
        self._watchdog.uneven_phase()
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # unwrap a LightningOptimizer
        module = self.lightning_module
        if self._pipelined is None or self.layout.num_stages == 1:
            return optimizer.state_dict()
        assert module is not None
        if self._saves_sharded:  # written by `save_checkpoint`
            return name_optimizer_state(optimizer.state_dict(), group_names(module, optimizer))
        return whole_optimizer_state(
            optimizer, module, self._pipelined.parameter_order, self.groups.stage_ranks, self.global_rank, self.groups.meta
        )

    @property
    def _saves_sharded(self) -> bool:
        """Checkpoints go sharded when asked, and by default for a model built on the meta device."""
        if self._save_distributed_checkpoint is not None:
            return self._save_distributed_checkpoint
        return self._deferred

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None
    ) -> None:
        self._watchdog.uneven_phase()
        if self._pipelined is None and "optimizer_states" in checkpoint:
            refuse_checkpoint_without_stages(isinstance(self.launcher, SpawnedRanks), filepath)
        if not (self._saves_sharded and self._pipelined is not None and self.layout.num_stages > 1):
            return super().save_checkpoint(checkpoint, filepath, storage_options)  # rank 0 writes the whole model
        if storage_options is not None:
            raise TypeError("sharded checkpoints are written with torch.distributed.checkpoint, which takes no"
                            f" storage_options (got {storage_options!r}); pass save_distributed_checkpoint=False to"
                            " write one file through the checkpoint IO plugin.")
        save_sharded(checkpoint, filepath, self._pipelined.state_keys, self._pipelined.parameter_order)

    def save_pretrained(
        self, directory: str | Path, prefix: str | None = None, dtype: torch.dtype | str | None = None
    ) -> None:
        """Write the model as a Hugging Face directory that ``from_pretrained`` loads: one safetensors shard per
        stage, written by the stage that holds it (nothing is gathered), the index and the model's config written
        by global rank 0. Call it on every rank, as ``trainer.save_checkpoint``, after ``fit`` or in a callback.

        ``prefix``: where the library's model sits in the LightningModule (``"model."``), whose keys lose it; by
        default the prefix the pretrained weights were mapped with, else the one Hugging Face model's place, else
        none. Keys outside it are left out (a warning names them). ``dtype``: cast every tensor (``"bfloat16"``);
        by default each keeps its own.
        """
        module = self.lightning_module
        if self._pipelined is None or module is None:
            raise RuntimeError(
                f"save_pretrained({str(directory)!r}) needs the pipeline's stages, which this process does not hold"
                " (the launching process of gpipe_spawn / gpipe_fork, or a run that failed). Call it on every rank"
                " with the default start method, or write a checkpoint and run"
                " `python -m lightning_pipe.export_pretrained CHECKPOINT DIRECTORY`."
            )
        if prefix is None:
            prefix = self._pretrained_prefix if self._pretrained_prefix is not None else library_model_prefix(module)
        if not any(key.startswith(prefix) for key in self._pipelined.state_keys):
            raise ValueError(
                f"save_pretrained(prefix={prefix!r}): no key of the model starts with it; give the path of the model"
                f" to write in the LightningModule, with its dot (e.g. {library_model_prefix(module) or 'model.'!r})."
            )
        left_out = export_pretrained_by_stage(
            module, self._pipelined, Path(directory), prefix, dtype, self.stage_index, self.groups.stage_ranks,
            self.global_rank, self.groups.meta, writes=self.layout.replica(self.global_rank) == 0,
        )
        if left_out:
            rank_zero_warn(f"save_pretrained left out the keys outside the prefix {prefix!r}: {left_out}")
        self.barrier()  # every rank returns once the directory is complete

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self._pipelined is None or self.layout.num_stages == 1 or checkpoint.get(SHARDED):
            return super().load_optimizer_state_dict(checkpoint)
        assert self.lightning_module is not None
        for optimizer, saved in zip(self.optimizers, checkpoint["optimizer_states"]):
            load_stage_optimizer_state(
                optimizer, saved, self.lightning_module, self._pipelined.parameter_order, self.groups.meta,
                self.root_device,
            )

    # ---- collectives ---------------------------------------------------------------------------------------------

    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        """Reduce across data-parallel replicas of this stage (logged values are already the same on every stage)."""
        if not isinstance(tensor, Tensor):
            return tensor
        group = group if group is not None else self.groups.replicas
        if dist.get_world_size(group) == 1:
            return tensor
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        return super().all_gather(tensor, group if group is not None else self.groups.replicas, sync_grads)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        flag = torch.tensor(int(decision), device=self.root_device)
        work = dist.all_reduce(flag, async_op=True)
        decision_wait = self._watchdog.collective("a decision of every rank", dist.group.WORLD)
        self._watchdog.wait([work], decision_wait, dist.group.WORLD)
        return bool(flag == self.world_size) if all else bool(flag)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if dist.is_available() and dist.is_initialized():
            barrier = self._watchdog.collective("the other ranks at a barrier", dist.group.WORLD)
            self._watchdog.wait([dist.barrier(async_op=True)], barrier, dist.group.WORLD)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not (dist.is_available() and dist.is_initialized()):
            return obj
        holder = [obj]
        if self.global_rank == src:
            waited = self._watchdog.collective("a value broadcast to every rank", dist.group.WORLD, sending=True)
        else:
            waited = Wait(f"a value broadcast by rank {src}", (src,))
        with self._watchdog.waiting(waited):
            dist.broadcast_object_list(holder, src)
        return holder[0]

    # ---- teardown ------------------------------------------------------------------------------------------------

    def on_exception(self, exception: BaseException) -> None:
        # Another stage may be gone: teardown must not wait on it to gather the model.
        self._failed = True
        self._watchdog.uneven_phase()
        keep_process_groups_at_exit()
        if not self._ending_started_ranks:
            self._ending_started_ranks = end_started_ranks_at_exit(self._launcher)

    def teardown(self) -> None:
        self._watchdog.stop()
        if self._stop_signals is not None:
            self._stop_signals.stop()
        module = self.lightning_module
        if self._undo_summaries is not None:
            self._undo_summaries()
            self._undo_summaries = None
        if module is not None:
            for hook in self._wrapped_hooks:
                module.__dict__.pop(hook, None)
            revert_batch_norms(module)
            if self._pipelined is not None and not self._failed:
                restore_whole_model(
                    module, self._pipelined, self.groups.stage_ranks, self.global_rank, self.groups.pipeline,
                    self.root_device, self._deferred, self._gather_model_after_run,
                )
        self._wrapped_hooks = []
        if self._failed:  # another stage may be gone: no checkpoint can gather the stages any more
            self._pipelined = None
        # Otherwise `_pipelined` stays: a checkpoint saved after the run gathers every stage's optimizer state.
        with _meta_tensors_left_in_place(module):
            super().teardown()

    @classmethod
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


@contextmanager
def _meta_tensors_left_in_place(module: nn.Module | None) -> Generator[None, None, None]:
    """Lightning's teardown moves the model to the CPU. A tensor on the meta device (a layer another rank trained, or
    one never materialised because the run failed before) has no data to move: it stays where it is."""
    if module is None or not holds_meta_tensors(module):
        yield
        return
    module.cpu = lambda: module._apply(lambda t: t if t.is_meta else t.cpu())  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.cpu


def _require_automatic_optimization(module: LightningModule) -> None:
    if not module.automatic_optimization:
        raise RuntimeError(
            "GPipeStrategy supports automatic optimization only: the pipeline drives backward itself, so"
            " `self.manual_backward` cannot reach the other stages. Set `self.automatic_optimization = True` and"
            " return the loss from training_step."
        )


def _epoch_last_batch_reached(trainer: Trainer) -> int | None:
    """The size of the training DataLoader's smaller last batch, if this fit reaches it: ``limit_train_batches`` or
    ``max_steps`` may end the epoch first (then a BatchNorm need not fit it; a later step checks any new size)."""
    loader = trainer.train_dataloader
    size = epoch_last_batch_size(loader)
    if size is None:
        return None
    batches = len(loader)  # type: ignore[arg-type]
    if trainer.num_training_batches < batches:
        return None
    if trainer.max_steps != -1 and trainer.max_steps * trainer.accumulate_grad_batches < batches:
        return None
    return size
