"""``schedule="auto"``: at set-up, the configuration predicted fastest within the memory budget, the same on every rank.

Global rank 0 profiles the pipelined blocks (:func:`~lightning_pipe.partition.profiling.block_cost_model`: forward,
input gradient, weight gradient and bytes, at the smallest and the largest micro-batch a candidate uses; on
``example_input_array`` or ``sample=``, else on the first training batch, through the training step), ranks every
configuration with :mod:`lightning_pipe.schedules.choice` and broadcasts the fastest that fits; every rank then runs
with settings that name it, as if the user had written them. The order is sound because the processes start (and
their rank layout is fixed) with the loss on the last stage, which every schedule ``auto`` may choose keeps: ``zbv``,
whose loss is on stage 0, is left to the user (``lightning-pipe plan`` ranks it).

May import: every layer below the pipeline. Imported by: :mod:`lightning_pipe.pipeline` and the ``plan`` command.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.trainer.states import TrainerFn
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_pipe.partition.counts import ranges_from_sizes, split_evenly
from lightning_pipe.execution.process_groups import PipelineGroups, decided_on_rank_zero
from lightning_pipe.partition.balance import min_max_partition
from lightning_pipe.partition.microbatch import batch_size_of
from lightning_pipe.partition.profiling import TrainingBatch, block_cost_model, profiling_input
from lightning_pipe.partition.step_probe import first_training_batch, random_state_kept
from lightning_pipe.schedules.choice import (
    AUTO_SCHEDULES,
    RECOMPUTE_MODES,
    Configuration,
    CostModel,
    Partition,
    PlannedConfiguration,
    choose,
    configurations,
    plan_table,
    rank_configurations,
    runtime_costs,
    size_text,
    why,
)
from lightning_pipe.schedules.planner import RuntimeCosts
from lightning_pipe.settings import PipelineSettings

SHOWN_ROWS = 10  # of the predicted table, in the start-up's message


@dataclass(frozen=True)
class ScheduleChoice:
    """What ``schedule="auto"`` chose: the configuration, its predicted step (seconds) and memory of the most loaded
    stage (bytes), and the message that shows the choice, why, and the predicted table."""

    configuration: Configuration
    step: float
    memory_bytes: float
    message: str


def decide_schedule(
    module: LightningModule, blocks: nn.Sequential, settings: PipelineSettings, groups: PipelineGroups
) -> tuple[PipelineSettings, ScheduleChoice | None]:
    """The settings with the configuration chosen (a collective: every rank calls it at set-up), and the choice
    (``None`` outside a fit, where GPipe runs the forwards: no training step to choose for)."""
    check_module_takes_auto(module, blocks, settings)  # the same model on every rank: the same refusal
    trainer = module._trainer
    if trainer is None or trainer.state.fn != TrainerFn.FITTING:
        v = settings.virtual_stages or 1
        fallback = Configuration(
            "gpipe" if v == 1 else "interleaved_1f1b", settings.pipeline_config(groups.num_stages).num_micro_batches,
            v, settings.recompute or "except_last",
        )
        return settled(settings, fallback), None

    def decide() -> ScheduleChoice:
        with random_state_kept():
            batch = first_training_batch(trainer, module)
        if batch is None:
            raise ValueError(
                "schedule='auto' chooses for the training batch, but the training DataLoader's first batch could"
                " not be read at set-up; choose the schedule yourself (schedule='gpipe', ...)."
            )
        rows, chosen, text = plan_schedule(
            module, blocks, settings, groups.num_stages, batch_size_of(batch), groups.device,
            settings.memory_budget or device_memory(groups.device, groups.layout.world_size),
        )
        return ScheduleChoice(chosen.configuration, chosen.step, chosen.memory_bytes, text)

    decided = decided_on_rank_zero(decide, "choose the schedule", groups.rank, groups.watchdog)
    return settled(settings, decided.configuration), decided


def plan_schedule(
    module: nn.Module,
    blocks: nn.Sequential,
    settings: PipelineSettings,
    num_stages: int,
    batch_size: int,
    device: torch.device,
    memory_budget: float | None,
    schedules: Sequence[str] = AUTO_SCHEDULES,
) -> tuple[list[PlannedConfiguration], PlannedConfiguration, str]:
    """Profile ``blocks`` on ``device`` and rank every configuration the settings leave open: the table, the choice
    and the message that shows both."""
    candidates = candidates_for(settings, num_stages, batch_size, len(blocks), schedules)
    counts = [c.num_micro_batches for c in candidates]
    sizes = (max(1, batch_size // max(counts)), max(1, batch_size // min(counts)))
    sample = profiling_input(settings.sample, module)  # during a fit without one, the first training batch
    if sample is None:
        raise ValueError(
            "schedule='auto' profiles every block on a sample input, but there is none: GPipeStrategy got no"
            " sample, the LightningModule has no example_input_array, and the training DataLoader's first batch"
            " could not be read at set-up; set `self.example_input_array = <an input of forward>` in the module's"
            " __init__, pass GPipeStrategy(sample=...), or choose the schedule yourself."
        )
    model = block_cost_model(module, blocks, sample, device, sizes)
    source = f"profiled on {device}" + (", on the first training batch" if isinstance(sample, TrainingBatch) else "")
    return ranked_choice(
        model, settings, num_stages, batch_size, memory_budget, candidates, source, runtime=runtime_costs(device.type)
    )


def ranked_choice(
    model: CostModel,
    settings: PipelineSettings,
    num_stages: int,
    batch_size: int,
    memory_budget: float | None,
    candidates: Sequence[Configuration],
    source: str,
    shown: int | None = SHOWN_ROWS,
    runtime: RuntimeCosts = RuntimeCosts(),
) -> tuple[list[PlannedConfiguration], PlannedConfiguration, str]:
    """The candidates ranked for ``model``'s costs plus the runtime's own (``runtime``: per action and per message),
    the fastest that fits, and the message saying both."""
    rows = rank_configurations(
        model, num_stages, batch_size, memory_budget, candidates, partition_for(settings), runtime
    )
    chosen = choose(rows)
    budget = "no memory budget" if memory_budget is None else f"a memory budget of {size_text(memory_budget)}"
    text = (
        f"Schedule chosen for {num_stages} stages, batches of {batch_size} samples and {budget} (costs {source};"
        f" runtime: {runtime}): {why(rows, chosen)}\n{plan_table(rows, shown)}"
    )
    return rows, chosen, text


def candidates_for(
    settings: PipelineSettings, num_stages: int, batch_size: int, num_blocks: int,
    schedules: Sequence[str] = AUTO_SCHEDULES,
) -> list[Configuration]:
    """The configurations open to the choice: what the user set stays fixed (``num_micro_batches``,
    ``virtual_stages``, ``checkpoint``; a ``balance`` list fixes the chunk count)."""
    if settings.virtual_stages is not None:
        chunks: list[int] | None = [settings.virtual_stages]
    elif isinstance(settings.balance, list):
        chunks = [max(1, len(settings.balance) // num_stages)]
    else:
        chunks = None
    found = configurations(
        num_stages, batch_size, num_blocks, schedules,
        [settings.num_micro_batches] if settings.num_micro_batches else None, chunks,
        [settings.recompute] if settings.recompute else RECOMPUTE_MODES,
    )
    if not found:
        raise ValueError(
            f"schedule='auto' has no configuration to choose from for {num_stages} stages, {num_blocks} blocks and"
            f" batches of {batch_size} (virtual_stages={settings.virtual_stages}); unset virtual_stages or choose the"
            " schedule yourself."
        )
    return found


def partition_for(settings: PipelineSettings) -> Partition:
    """How the prediction cuts the blocks into chunks, as the partition will: a ``balance`` list as given,
    ``"time"`` by the blocks' time, otherwise evenly (``"parameters"`` and ``"memory"`` approximated so)."""
    balance = settings.balance
    if isinstance(balance, list):
        return lambda costs, parts: ranges_from_sizes(balance)
    if balance == "time":
        return lambda costs, parts: ranges_from_sizes(min_max_partition(costs, parts))
    return lambda costs, parts: split_evenly(len(costs), parts)


def check_module_takes_auto(module: nn.Module, blocks: nn.Sequential, settings: PipelineSettings) -> None:
    """Refuse ``schedule="auto"`` for a module whose results its choice would change: BatchNorm outside the
    pipelined blocks (a per-micro-batch schedule runs it once per micro-batch, on the micro-batch's statistics,
    where GPipe runs it on the whole batch's), or BatchNorm in the blocks with the micro-batch count left to it
    (the count decides the statistics each micro-batch is normalised by)."""
    inside = {id(m) for m in blocks.modules()}
    norms = [(name, m) for name, m in module.named_modules() if isinstance(m, _BatchNorm) and m.training]
    outside = [name for name, m in norms if id(m) not in inside]
    if outside:
        raise ValueError(
            f"schedule='auto' may choose a per-micro-batch schedule, which runs the code around the pipelined blocks"
            f" once per micro-batch, but {type(module).__name__} has BatchNorm outside them ({outside[0]!r}), whose"
            " statistics would then come from each micro-batch instead of the batch; choose the schedule yourself"
            " (schedule='gpipe' keeps them), or move the BatchNorm into the pipelined blocks."
        )
    if norms and settings.num_micro_batches is None:
        raise ValueError(
            f"schedule='auto' chooses the micro-batch count, but {type(module).__name__}'s BatchNorm ({norms[0][0]!r})"
            " normalises each micro-batch by its own statistics, so the choice would change what the model computes;"
            " set num_micro_batches (auto then chooses the schedule, virtual_stages and checkpoint only), or choose"
            " the schedule yourself."
        )


def settled(settings: PipelineSettings, configuration: Configuration) -> PipelineSettings:
    """``settings`` naming ``configuration``, as if the user had written it."""
    return replace(
        settings, schedule=configuration.schedule, num_micro_batches=configuration.num_micro_batches,
        virtual_stages=configuration.virtual_stages, recompute=configuration.recompute, memory_budget=None,
    )


def device_memory(device: torch.device, processes: int) -> int:
    """What a device has: a GPU's total memory; elsewhere the machine's physical memory over ``processes``."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")) // max(1, processes)
