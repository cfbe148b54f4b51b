"""The pipeline built on one rank: the user's model split into stages, and what runs this rank's.

:func:`build_pipeline` is two steps. :func:`decide_pipeline` decides what every rank must agree on: it checks that
every rank built the same model, finds the region (the blocks to pipeline) and decides the partition on global rank
0. :func:`assemble_rank` builds this rank's part: it plans the pretrained weights' load, puts this rank's
:class:`~lightning_pipe.execution.stage.StageBlocks` into the model, makes its tensors real and fills them, and
builds the engine, the step runtime, the training step in its schedule's mode, the gradients and the tracer. What it
built is one :class:`BuiltPipeline`, a record the strategy keeps from ``setup`` to the interpreter's exit; the
strategy holds the objects that do its hooks' work (the runtime, the training step, the gradients, the tracer)
directly, and the functions here start the run, report the stages and put the whole model back.

May import: every folder below it (``schedules`` to ``integration``). Imported by: the strategy and its
``pytorch_lightning`` twin only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.optim import Optimizer

from lightning_pipe.auto_schedule import ScheduleChoice, decide_schedule
from lightning_pipe.checkpoints.pretrained import PretrainedLoad, PretrainedWeights, holds_pretrained_weights
from lightning_pipe.checkpoints.whole_model import WholeModelLayout, restore_whole_model, tied_aliases
from lightning_pipe.partition.counts import PipelineParallelConfig
from lightning_pipe.execution.batchnorm import defer as defer_batch_norms
from lightning_pipe.execution.compiling import check_compiled, compile_stage, compiles_in_first_steps, uncompiled_name
from lightning_pipe.execution.engine import PipelineEngine
from lightning_pipe.execution.gradients import StageGradients
from lightning_pipe.execution.materialize import ModuleInit, global_seed, holds_meta_tensors, materialize
from lightning_pipe.execution.outside import (
    OutsideModules,
    OutsideOwnership,
    built_real_everywhere,
    decide_outside_places,
    outside_module_stages,
)
from lightning_pipe.execution.process_groups import (
    MESH_DIMENSIONS,
    PipelineGroups,
    broadcast_object,
    decide_over_world,
    decided_on_rank_zero,
)
from lightning_pipe.execution.random_streams import StageRandomStreams
from lightning_pipe.execution.replayed_logs import StepOutcome
from lightning_pipe.execution.runtime import StageRuntime
from lightning_pipe.execution.sharding import StageSharding
from lightning_pipe.execution.stage import StageBlocks
from lightning_pipe.execution.tensor_parallel import (
    BlockPlans,
    StageTensorParallel,
    TakenSplit,
    refuse_split_ties,
    resolve_plan,
    take_split_modules,
)
from lightning_pipe.execution.steps import TrainingStep, training_step_for
from lightning_pipe.execution.tied import TiedParameters, parameters_shared_across_stages
from lightning_pipe.integration.lightning_packages import overrides
from lightning_pipe.integration.model_summary import summarize_whole_model
from lightning_pipe.partition.balance import (
    PartitionPlan,
    plan_partition,
    profiling_sample,
    recompute_fraction,
    stage_ranges,
)
from lightning_pipe.partition.collected_outputs import check_nothing_collected_inside_blocks
from lightning_pipe.partition.fingerprint import different_models_message, fingerprint_digest, model_fingerprint
from lightning_pipe.partition.memory_estimate import StateLayout
from lightning_pipe.partition.placement import (
    balance_charges,
    outside_rows,
    parameter_holders,
    replicated_outside_parameters,
    where_held,
)
from lightning_pipe.partition.region import Region, TooFewBlocks, chosen_region, suggested_chain
from lightning_pipe.partition.step_probe import first_batch_step, fit_training_step, random_state_kept
from lightning_pipe.partition.topology import PipelineLayout
from lightning_pipe.schedules.simulator import ideal_bubble
from lightning_pipe.settings import PipelineSettings
from lightning_pipe.trace.stage_summary import (
    StageSummary,
    build_stage_summary,
    chunk_parameters_per_rank,
    model_checkpoint_note,
    outside_warning,
    self_checkpointing_warning,
)
from lightning_pipe.trace.timeline import StepTimeline
from lightning_pipe.trace.tracer import TRACE_FILE_NAME, PipelineTracer

@dataclass(frozen=True)
class BuiltPipeline:
    """What :func:`build_pipeline` built on this rank: a record, never changed. The strategy holds the objects that
    do the work of its hooks (``runtime``, ``step``, ``gradients``, ``tracer``) directly; the functions below start
    the run (:func:`start_pipeline`), report the stages (:func:`stage_summary`, :func:`announce`) and put the
    whole model back (:func:`put_whole_model_back`)."""

    settings: PipelineSettings
    config: PipelineParallelConfig  # the resolved stage and micro-batch counts
    groups: PipelineGroups
    region: Region  # the blocks pipelined
    plan: PartitionPlan  # the blocks of each model chunk, as global rank 0 decided
    outside: list[tuple[str, int, str]]  # the modules outside the blocks: parameter count, which stages hold it
    # The user's pipelined module as it was, to put it back after the run; None once a failed run lost the stages.
    pipelined: WholeModelLayout | None
    replicated: list[nn.Parameter]  # parameters outside the pipelined blocks, held by every stage
    outside_modules: OutsideModules  # the outside modules other stages hold, stood in for here
    runtime: StageRuntime
    step: TrainingStep  # the training step in its schedule's mode, whole-batch or per-micro-batch
    # This rank's gradients before the optimizer step; with data_parallel="shard" or "full_shard" also the owner of
    # the stage's blocks sharded over its replicas (FSDP2), from `start_pipeline` on.
    gradients: StageGradients
    tracer: PipelineTracer | None  # gathers the stages' timelines; None for one stage or none asked for
    deferred: bool  # the pipelined module was built on the meta device
    compiles: bool  # torch.compile compiles code of this rank in its first steps (see StallRule: not measured before)
    pretrained_prefix: str | None = None  # where the pretrained model sits, once its weights were mapped
    schedule_choice: ScheduleChoice | None = None  # with schedule="auto": the choice, why, the predicted table


def start_pipeline(pipeline: BuiltPipeline, module: LightningModule, callbacks: Sequence[Any]) -> list[Callable[[], None]]:
    """Start the run on the model moved to its device: identical replicated state (the blocks then sharded, where
    asked), metrics synced within replicas, the epoch-end hooks on the loss stage, Lightning's summary of the whole
    model, the loss stage's random state on every stage. What undoes the changes to the user's objects, for
    teardown."""
    runtime, pipelined, gradients = pipeline.runtime, pipeline.pipelined, pipeline.gradients
    assert pipelined is not None
    precision = module._trainer.precision if module._trainer is not None else None
    gradients.start_identical(_held_outside_modules(pipelined, pipeline.groups.stage), precision)
    runtime.sync_metrics_within_replicas(module)
    undo = [
        runtime.run_epoch_end_hooks_on_last_stage(module),
        summarize_whole_model(
            callbacks, runtime.stage, pipelined.ranges, {name: where for name, _, where in pipeline.outside},
            pipeline.outside_modules.showing_whole_model,
            sharded_over=pipeline.groups.layout.num_replicas if gradients.sharding is not None else 1,
        ),
    ]
    if any(0 < len(stages) < pipeline.config.num_stages for _, stages, _ in pipelined.outside.values()):
        undo.append(runtime.share_outside_call_outputs(module))  # the loss stage alone holds the head
    runtime.share_outcome(module, StepOutcome())  # every stage starts from the loss stage's random state
    return undo


def _held_outside_modules(pipelined: WholeModelLayout, stage: int) -> list[tuple[str, nn.Module]]:
    """The outside modules ``stage`` holds and some other stage does not, by name."""
    return [(name, module) for name, (module, stages, _) in pipelined.outside.items() if stage in stages]


def stage_summary(pipeline: BuiltPipeline, devices: Sequence[str], busy_seconds: Sequence[float] | None) -> StageSummary:
    """The stage table (see :mod:`lightning_pipe.trace.stage_summary`); ``devices[s]`` names where stage ``s`` of
    the first pipeline runs."""
    settings, config = pipeline.settings, pipeline.config
    schedule, num_stages, split = settings.schedule, config.num_stages, settings.tensor_parallel_size > 1
    return build_stage_summary(
        pipeline.plan,
        pipeline.region.label,
        pipeline.groups.layout.pipeline_ranks(0),
        devices,
        sum(p.numel() for p in pipeline.replicated),
        config.num_micro_batches,
        settings.recompute,  # type: ignore[arg-type]
        busy_seconds,
        built_whole=not pipeline.deferred,
        outside=pipeline.outside,
        owners=[schedule.owner(k, num_stages) for k in range(len(pipeline.plan.ranges))],  # type: ignore[union-attr]
        schedule=schedule.name,  # type: ignore[union-attr]
        ideal_bubble=ideal_bubble(
            schedule, num_stages, config.num_micro_batches, settings.virtual_stages  # type: ignore[arg-type]
        ),
        data_parallel=settings.data_parallel,  # type: ignore[arg-type]
        num_replicas=pipeline.groups.layout.num_replicas,
        held_per_rank=_held_per_rank(pipeline) if split or settings.data_parallel != "replicate" else None,
        tensor_parallel=settings.tensor_parallel_size,
    )


def _held_per_rank(pipeline: BuiltPipeline) -> list[int]:
    """FSDP and TP hook: each chunk's parameters held by the rank with the largest part (see
    :func:`chunk_parameters_per_rank`)."""
    replicas = pipeline.groups.layout.num_replicas if pipeline.settings.data_parallel != "replicate" else 1
    plans = pipeline.gradients.tensor_plan
    return chunk_parameters_per_rank(pipeline.pipelined.sequential, pipeline.plan.ranges, replicas,  # type: ignore[union-attr]
                                     plans.rank_shapes if plans is not None else None)


def announce(pipeline: BuiltPipeline, module: LightningModule, summary: StageSummary, category: type[Warning]) -> None:
    """Print the stage summary, and warn of much of the model left outside the pipeline and of blocks that
    re-compute their activations themselves on top of the pipeline's re-computation."""
    if pipeline.schedule_choice is not None:
        rank_zero_info(pipeline.schedule_choice.message)
    rank_zero_info(str(summary))
    if (warning := outside_warning(summary, suggested_chain(module, pipeline.region))) is not None:
        rank_zero_warn(warning, category=category)
    recompute = pipeline.settings.recompute
    checkpointing_themselves = any(
        getattr(m, "gradient_checkpointing", None) is True for m in pipeline.runtime.stage.modules()
    )
    if checkpointing_themselves and recompute != "never":
        rank_zero_warn(self_checkpointing_warning(recompute), category=category)  # type: ignore[arg-type]


def put_whole_model_back(pipeline: BuiltPipeline, module: LightningModule, optimizers: Sequence[Any] = ()) -> None:
    """After the run: the user's pipelined module back in ``module`` (see
    :func:`~lightning_pipe.checkpoints.whole_model.restore_whole_model`); nothing once the stages were lost."""
    if pipeline.pipelined is None:
        return
    if (sharding := pipeline.gradients.sharding) is not None:  # FSDP hook: the modules (and optimizers) whole again
        sharding.make_whole(optimizers)
    if (split := pipeline.gradients.tensor_parallel) is not None:  # TP hook: the blocks (and optimizers) whole again
        split.make_whole(optimizers)
    groups = pipeline.groups
    restore_whole_model(
        module, pipeline.pipelined, groups.stage_ranks, groups.rank, groups.pipeline, groups.device, pipeline.deferred,
        pipeline.settings.gather_model_after_run,
    )


@dataclass(frozen=True)
class PipelineDecision:
    """What every rank decides alike at set-up, before any builds its stage: the settings (with ``schedule="auto"``,
    the configuration chosen), the blocks and how they are split, and which stages hold each outside module."""

    settings: PipelineSettings
    config: PipelineParallelConfig  # the resolved stage and micro-batch counts
    region: Region
    blocks: nn.Sequential  # the region's blocks in order, for the partition plan and the whole model
    plan: PartitionPlan
    held: list[list[int]]  # the blocks each stage holds
    module_stages: dict[str, frozenset[int]]  # the stages holding each outside module
    outside: list[tuple[str, int, str]]
    choice: ScheduleChoice | None
    tensor_plan: BlockPlans | None = None  # with tensor_parallel_size > 1: how each block is split


def build_pipeline(module: LightningModule, settings: PipelineSettings, groups: PipelineGroups, precision: Any) -> BuiltPipeline:
    """Split ``module`` into stages and build this rank's: a collective, called on every rank at set-up.
    ``precision`` is the strategy's precision plugin (its dtype and gradient scaler). Blocks that ``configure_model``
    split itself are whole until this rank's are split back (see :func:`take_split_modules`)."""
    taken = take_split_modules(module, groups.mesh[MESH_DIMENSIONS["tp"]] if groups.mesh is not None else None)
    return assemble_rank(module, decide_pipeline(module, settings, groups, taken), groups, precision)


def decide_pipeline(
    module: LightningModule, settings: PipelineSettings, groups: PipelineGroups,
    taken: dict[str, TakenSplit] | None = None,
) -> PipelineDecision:
    """Decide the pipeline on every rank alike (rank 0 decides what measurements could make differ): a collective.
    ``taken``: the split ``configure_model`` made, by module name (see :func:`take_split_modules`)."""
    config = settings.pipeline_config(groups.num_stages)
    check_every_rank_built_the_same_model(module, groups.layout)
    region = broadcast_object(  # every rank splits the same blocks
        find_pipelined_region(module, settings, config.num_stages, module._trainer), 0, groups.rank, groups.watchdog
    )
    check_compiled(module, region)
    check_nothing_collected_inside_blocks(module, region, config.num_stages)
    blocks = nn.Sequential(*region.blocks(module))
    choice = None
    if settings.is_auto:  # the configuration chosen now, before the chunks are cut (lightning_pipe.auto_schedule)
        settings, choice = decide_schedule(module, blocks, settings, groups)
        config = settings.pipeline_config(groups.num_stages)
    tensor_plan = None
    if settings.tensor_parallel_size > 1:  # TP hook: the plan checked against the whole model, on every rank alike
        tensor_plan = resolve_plan(module, region.names, list(blocks), settings.tensor_parallel_plan,
                                   settings.tensor_parallel_size, taken=taken)
    places = decide_outside_places(module, region, groups)
    plan = decide_partition(module, blocks, settings, groups, balance_charges(module, region, places), tensor_plan)
    held = _blocks_held_by_stage(plan, settings, config.num_stages)
    module_stages = outside_module_stages(places, held, groups)
    outside = outside_rows(module, region, module_stages, config.num_stages)
    return PipelineDecision(settings, config, region, blocks, plan, held, module_stages, outside, choice, tensor_plan)


def assemble_rank(
    module: LightningModule, decision: PipelineDecision, groups: PipelineGroups, precision: Any
) -> BuiltPipeline:
    """This rank's part of the pipeline ``decision`` describes: its stage put into ``module`` and made real, the
    outside modules it does not hold stood in for, its runtime, training step and gradients."""
    settings, config, region, sequential = decision.settings, decision.config, decision.region, decision.blocks
    plan, held, module_stages, outside = decision.plan, decision.held, decision.module_stages, decision.outside
    blocks = list(sequential)
    ties = parameters_shared_across_stages(blocks, held)  # before materialising replaces parameters
    holders, sources, names_of = parameter_holders(module, module_stages)
    built_real = built_real_everywhere(module, list(module_stages), groups)
    state_keys, parameter_order = list(module.state_dict().keys()), [name for name, _ in module.named_parameters()]
    aliases = tied_aliases(module)  # before materialising unties the stages' copies
    pretrained = plan_pretrained_load(module, settings.pretrained)  # checked on the whole model: every rank alike
    tensor_plan = decision.tensor_plan
    if tensor_plan is not None:  # TP hook: a split layer may not hold a parameter tied across stages
        refuse_split_ties(tensor_plan, [(tie.places, region.names) for tie in ties])
    stage = _install_stage(module, region, plan, settings, groups)
    held_elsewhere = {name: stages for name, stages in module_stages.items() if groups.stage not in stages}
    outside_modules = OutsideModules(
        module, {name: where_held(stages, config.num_stages) for name, stages in held_elsewhere.items()}, groups.device
    )
    outside_modules.install()  # before materialising: what other stages hold is never allocated here
    check_every_stage_holds_parameters(module, stage, groups)
    # Built on the meta device: only what this rank runs becomes real (its stage, the outside modules it holds).
    deferred = decide_over_world(holds_meta_tensors(sequential), every=False, device=groups.device,
                                 watchdog=groups.watchdog)
    _make_real(module, pretrained, precision, groups, settings.init_module)
    if settings.deferred_batch_norm:
        for block in stage.blocks:
            defer_batch_norms(block)
    pipelined = WholeModelLayout(
        region.label, sequential, held, state_keys, parameter_order,
        put_back=partial(_put_back, module, stage, outside_modules, names_of),
        block_names=region.names, aliases=aliases,
        outside={  # what some stage does not hold: the module as built, its holders, built real everywhere or not
            name: (outside_modules.originals.get(name) or module.get_submodule(name), tuple(sorted(stages)), built_real[name])
            for name, stages in module_stages.items() if len(stages) < config.num_stages
        },
    )
    replicated = replicated_outside_parameters(module, region, holders, names_of, config.num_stages)
    shared = {name: stages for name, stages in holders.items() if 1 < len(stages) < config.num_stages}
    ownership = OutsideOwnership(module, shared, sources, names_of, groups.stage, groups.layout, groups.timeout)
    tied = TiedParameters(ties, stage, groups.layout, replicated, groups.timeout)
    compile_stage(module, region, stage, settings.compile_options)
    timeline = StepTimeline(groups.device, enabled=settings.log_bubble_fraction or bool(settings.trace_steps))
    gradients = StageGradients(
        groups, replicated, tied, ownership, stage, settings.data_parallel, tensor_plan  # type: ignore[arg-type]
    )
    runtime = _stage_runtime(stage, settings, config, groups, timeline, gradients)
    return BuiltPipeline(
        settings, config, groups, region, plan, outside, pipelined, replicated, outside_modules,
        runtime=runtime,
        step=training_step_for(runtime),
        gradients=gradients,
        tracer=_tracer(module, settings, config, groups, timeline),
        deferred=deferred,
        compiles=compiles_in_first_steps(module, stage),
        pretrained_prefix=pretrained.mapping.prefix if pretrained is not None else None,
        schedule_choice=decision.choice,
    )


def check_partition_before_launch(
    model: LightningModule, trainer: Trainer | None, settings: PipelineSettings, num_processes: int,
    fit_loaders: Any = None,
) -> None:
    """Raise the partition's errors (no Sequential, too many stages, a bad balance) before processes start;
    ``fit_loaders``: the ``train_dataloaders`` given to ``trainer.fit``."""
    fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
    if fitting:
        require_automatic_optimization(model)
    if overrides(model, "configure_model"):
        return  # the blocks may exist only once configure_model has run, in each process: set-up checks them
    num_stages = settings.pipeline_config(num_processes).num_stages
    try:
        region = find_pipelined_region(model, settings, num_stages, trainer, fit_loaders)
    except TooFewBlocks as refused:
        if refused.step_unread:
            return  # set-up reads the first batch (a DataModule's, once set up) and decides with its step
        raise
    check_compiled(model, region)
    balance = settings.balance if isinstance(settings.balance, list) else None
    stage_ranges(settings.chunk_config(num_processes), len(region), balance)
    if not fitting:  # a fit profiles on its first training batch where there is no sample: set-up reads it
        profiling_sample(settings.balance, settings.sample, model)


def check_every_stage_holds_parameters(module: LightningModule, stage: StageBlocks, groups: PipelineGroups) -> None:
    """Raise on every rank, before the optimizers are built, if a stage of a fit holds no parameter: its optimizer
    would be built from none."""
    trainer = module._trainer
    if groups.num_stages == 1 or trainer is None or trainer.state.fn != TrainerFn.FITTING:
        return
    empty = next(module.parameters(), None) is None
    if not decide_over_world(empty, every=False, device=groups.device, watchdog=groups.watchdog):
        return
    found: list[Any] = [None] * dist.get_world_size()
    blocks = ", ".join(stage.region.names[i] for i in stage.indices)
    dist.all_gather_object(found, (groups.stage, blocks) if empty else None)
    stages = sorted({item for item in found if item is not None})
    described = "; ".join(f"stage {s} ({blocks})" for s, blocks in stages)
    raise ValueError(
        f"pipeline {'stages hold' if len(stages) > 1 else 'stage holds'} no parameters to train: {described}. Its"
        " blocks have none, and the modules outside the blocks live on the stages that run them (the embeddings on"
        " the first, the head on the last), so its optimizer would be built from no parameters. Give every stage a"
        " block with parameters: fewer stages, GPipeStrategy(balance=[...]) with blocks per stage, or a module_name"
        " naming blocks that all hold parameters."
    )


def require_automatic_optimization(module: LightningModule) -> None:
    if not module.automatic_optimization:
        raise RuntimeError(
            "GPipeStrategy supports automatic optimization only: the pipeline drives backward itself, so"
            " `self.manual_backward` cannot reach the other stages. Set `self.automatic_optimization = True` and"
            " return the loss from training_step."
        )


def check_every_rank_built_the_same_model(module: LightningModule, layout: PipelineLayout) -> None:
    """Raise on every rank if the ranks' models differ in any state-dict entry's name, shape or dtype."""
    world_size = dist.get_world_size()
    if world_size == 1:
        return
    fingerprint = model_fingerprint(module)
    digests: list[Any] = [None] * world_size
    dist.all_gather_object(digests, fingerprint_digest(fingerprint))
    if len(set(digests)) == 1:
        return
    every: list[Any] = [None] * world_size
    dist.all_gather_object(every, fingerprint)
    raise ValueError(different_models_message(every, lambda rank: f"rank {rank} (stage {layout.stage(rank)})"))


def find_pipelined_region(
    module: LightningModule, settings: PipelineSettings, num_stages: int, trainer: Trainer | None = None,
    fit_loaders: Any = None,
) -> Region:
    """The blocks to pipeline (see :func:`chosen_region`); with the ``trainer`` of a fit, also those that the
    training step chains, when what the model and its ``forward`` show leaves much of the model outside
    (``fit_loaders``: the ``train_dataloaders`` given to ``trainer.fit``, before the fit attaches them)."""
    sample = settings.sample if settings.sample is not None else getattr(module, "example_input_array", None)
    fitting = trainer is not None and trainer.state.fn == TrainerFn.FITTING
    read_step = partial(first_batch_step, trainer, module, fit_loaders) if fitting else None
    return chosen_region(
        module, uncompiled_name(module, settings.module_name), sample, read_step, num_stages,
        settings.virtual_stages or 1,
    )


def decide_partition(
    module: LightningModule,
    sequential: nn.Sequential,
    settings: PipelineSettings,
    groups: PipelineGroups,
    charges: Sequence[tuple[int, nn.Module]] = (),
    tensor_plan: BlockPlans | None = None,
) -> PartitionPlan:
    """The split, decided on global rank 0 (profiling there when ``balance`` asks) and broadcast, so that every
    rank applies the same split even where measurements differ between ranks; ``"parameters"`` and ``"memory"``
    count a rank's slice of the layers ``tensor_plan`` splits."""
    config = settings.chunk_config(groups.num_stages)

    def decide() -> PartitionPlan:
        deferred = holds_meta_tensors(sequential)
        if settings.balance == "time" and deferred:
            raise ValueError(
                "balance='time' profiles every block with its weights, but the pipelined module was built on the"
                " meta device (in configure_model() or under init_module(empty_init=True)), where it has none yet;"
                " use balance='parameters' or balance='memory' (neither needs weights: 'memory' is estimated on the"
                " meta device), a list of blocks per stage, or build the model in __init__."
            )
        fraction = recompute_fraction(settings.recompute, config.num_micro_batches)  # type: ignore[arg-type]
        # Built on the meta device, "memory" is estimated from the training step run there (memory_estimate).
        step = fit_training_step(module) if settings.balance == "memory" and deferred else None
        with random_state_kept():
            return plan_partition(
                module, sequential, config, settings.balance, settings.sample, groups.device, fraction, charges,
                step, settings.schedule.per_micro_batch,  # type: ignore[union-attr]
                StateLayout(settings.data_parallel, groups.layout.num_replicas,
                            tensor_plan.rank_elements(list(sequential)) if tensor_plan is not None else {}),
            )

    return decided_on_rank_zero(decide, "partition the model", groups.rank, groups.watchdog)


def plan_pretrained_load(module: LightningModule, weights: PretrainedWeights | None) -> PretrainedLoad | None:
    """The pretrained weights to read into this model, checked against it; None when none were asked for or
    this model object holds them already (from an earlier run, which may have trained them)."""
    if weights is None:
        return None
    if holds_pretrained_weights(module):
        rank_zero_info(f"The model holds the weights of an earlier run: {str(weights.path)!r} is not read again.")
        return None
    load = PretrainedLoad.plan(module, weights)
    rank_zero_info(
        f"Starting from the pretrained weights {load.stored.describe()}: {load.mapping.describe(load.stored)};"
        " each rank reads its stage's share."
    )
    return load


def _blocks_held_by_stage(plan: PartitionPlan, settings: PipelineSettings, num_stages: int) -> list[list[int]]:
    """The blocks each stage holds: those of every model chunk the schedule gives it."""
    schedule, v = settings.schedule, settings.virtual_stages
    return [
        sorted(i for k in schedule.chunks(s, num_stages, v) for i in plan.ranges[k])  # type: ignore[union-attr]
        for s in range(num_stages)
    ]


def _put_back(
    module: LightningModule, stage: StageBlocks, outside_modules: OutsideModules, names_of: dict[str, list[str]]
) -> None:
    """The user's modules back in place after the run, a parameter shared by outside modules one tensor again (each
    stage held its own copy: the one it holds, real, is kept)."""
    outside_modules.uninstall()
    stage.uninstall()
    with torch.no_grad():
        for names in names_of.values():
            if len(names) > 1:
                copies = [module.get_parameter(name) for name in names]
                kept = next((p for p in copies if not p.is_meta), copies[0])
                for name in names:
                    owner, _, attribute = name.rpartition(".")
                    setattr(module.get_submodule(owner) if owner else module, attribute, kept)


def _install_stage(
    module: LightningModule, region: Region, plan: PartitionPlan, settings: PipelineSettings, groups: PipelineGroups
) -> StageBlocks:
    """This rank's stage, put into ``module`` in place of the pipelined blocks."""
    index, num_stages = groups.stage, groups.num_stages
    chunks = settings.schedule.chunks(index, num_stages, settings.virtual_stages)  # type: ignore[union-attr]
    local = {k: plan.ranges[k] for k in chunks}
    holders = {i: s for s in range(num_stages) for k in settings.schedule.chunks(s, num_stages, settings.virtual_stages)  # type: ignore[union-attr]
               for i in plan.ranges[k]}
    stage = StageBlocks(module, region, local, index, num_stages, num_chunks=len(plan.ranges), block_stages=holders)
    stage.install()  # before materialising: the other stages' blocks are taken out
    return stage


def _make_real(
    module: LightningModule, pretrained: PretrainedLoad | None, precision: Any, groups: PipelineGroups,
    init_module: ModuleInit | None,
) -> None:
    """Allocate and initialise what this rank runs that was built on the meta device, then read the pretrained
    weights into it."""
    filled = pretrained.mapping.filled if pretrained is not None else ()
    seed = broadcast_object(global_seed(), 0, groups.rank, groups.watchdog)
    materialize(module, groups.device, seed, filled, init_module)
    if pretrained is not None:
        with precision.tensor_init_context():  # sets the precision's dtype as torch's default
            precision_dtype = torch.get_default_dtype()
        pretrained.fill(module, precision_dtype)


def _stage_runtime(
    stage: StageBlocks,
    settings: PipelineSettings,
    config: PipelineParallelConfig,
    groups: PipelineGroups,
    timeline: StepTimeline,
    gradients: StageGradients,
) -> StageRuntime:
    """The engine that runs the schedule on ``stage``, in the runtime that runs a step on this rank; ``gradients``
    hears of each chunk's backward of a micro-batch (under ``data_parallel="full_shard"`` it reduce-scatters then)."""
    schedule, v, index = settings.schedule, settings.virtual_stages, groups.stage
    # One stage draws from the global stream, as one device does; several need streams of their own.
    streams = StageRandomStreams(groups.device, index, groups.replica) if config.num_stages > 1 else None
    engine = PipelineEngine(
        stage, config.num_micro_batches, settings.recompute,  # type: ignore[arg-type]
        links={peer: groups.link(peer) for peer in schedule.neighbours(index, config.num_stages, v)},  # type: ignore[union-attr]
        schedule=schedule,  # type: ignore[arg-type]
        virtual_stages=v,  # type: ignore[arg-type]
        timeline=timeline,
        random_streams=streams,
        backward_done=gradients.chunk_backward_done if settings.data_parallel == "full_shard" else None,
    )
    return StageRuntime(
        groups, engine, stage, on_model_checkpoint=partial(rank_zero_info, model_checkpoint_note(settings.recompute))
    )


def _tracer(
    module: LightningModule,
    settings: PipelineSettings,
    config: PipelineParallelConfig,
    groups: PipelineGroups,
    timeline: StepTimeline,
) -> PipelineTracer | None:
    """The tracer that gathers the stages' timelines, where a timeline is kept and there are several stages."""
    if not (timeline.enabled and config.num_stages > 1):
        return None
    trace_dir = settings.trace_dir or Path(module.trainer.default_root_dir)
    return PipelineTracer(
        timeline, groups.pipeline_cpu, groups.stage, config.num_stages, groups.rank, settings.trace_steps,
        trace_path=trace_dir / TRACE_FILE_NAME if groups.rank == 0 else None,
        ideal_bubble=partial(ideal_bubble, settings.schedule, config.num_stages, virtual_stages=settings.virtual_stages),
    )


def whole_view(
    pipeline: BuiltPipeline | None, optimizers: Sequence[Optimizer] = (), as_shards: bool = False
) -> AbstractContextManager[None]:
    """FSDP and TP hook: one-file checkpoints read and write the modules sharded over the replicas as whole tensors
    (see :meth:`~lightning_pipe.execution.sharding.StageSharding.whole_view`); sharded ones (``as_shards``) their
    DTensors as they are, each rank its shard. Blocks split with tensor parallelism are whole in one-file checkpoints
    (see :meth:`~lightning_pipe.execution.tensor_parallel.StageTensorParallel.whole_view`) and DTensors in sharded
    ones, each rank its slice (torch.distributed.checkpoint reshards them): either resumes on another
    tensor-parallel size."""
    sharding = pipeline.gradients.sharding if pipeline is not None else None
    split = pipeline.gradients.tensor_parallel if pipeline is not None else None
    if split is not None and split.blocks and not as_shards:  # TP hook: the sharded DTensors of split blocks too
        return _both_whole(sharding, split, optimizers)
    if as_shards or sharding is None or not sharding.modules:
        return nullcontext()
    return sharding.whole_view(optimizers)


@contextmanager
def _both_whole(
    sharding: StageSharding | None, split: StageTensorParallel, optimizers: Sequence[Optimizer]
) -> Iterator[None]:
    with sharding.whole_view(optimizers) if sharding is not None and sharding.modules else nullcontext():
        with split.whole_view(optimizers):
            yield
