"""Which contiguous blocks each stage gets: evenly, by an explicit ``balance=[...]``, or balanced by a cost per block.

A pipeline runs at the pace of its most expensive stage. Given a cost per block (its parameter count, its profiled
time or memory), :func:`min_max_partition` returns the contiguous split whose most expensive stage is as cheap as
possible: exactly, by dynamic programming, not by a greedy fill. :func:`plan_partition` turns a ``balance=`` choice
into a split, profiling the blocks (:mod:`lightning_pipe.partition.profiling`) when the choice asks for it. The rules a
balance must follow are checked here, once: :mod:`lightning_pipe.settings` applies the ones it can before any process
starts.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, Union, get_args

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import nn

from lightning_pipe.partition.counts import PipelineParallelConfig, check_stage_count, ranges_from_sizes, split_evenly
from lightning_pipe.partition.memory_estimate import (
    StateLayout,
    estimate_block_memory,
    held_micro_batches,
    memory_costs,
)
from lightning_pipe.partition.profiling import BlockProfile, pipelined_input, profile_blocks, profiling_input
from lightning_pipe.schedules.builtin import SCHEDULES

BalanceMode = Literal["uniform", "parameters", "time", "memory"]
BALANCE_MODES: tuple[str, ...] = get_args(BalanceMode)
PROFILED_MODES = ("time", "memory")

Balance = Union[Sequence[int], BalanceMode, None]


# ---- the split -------------------------------------------------------------------------------------------------------


def stage_ranges(config: PipelineParallelConfig, num_blocks: int, balance: Sequence[int] | None = None) -> list[range]:
    """Block range of every stage: from ``balance`` (blocks per stage) when given, else an even split."""
    if balance is None:
        return split_evenly(num_blocks, config.num_stages)
    sizes = list(balance)
    check_block_counts(sizes)
    check_one_count_per_stage(sizes, config.num_stages)
    if sum(sizes) != num_blocks:
        raise ValueError(
            f"balance={sizes} sums to {sum(sizes)} but the pipelined module has {num_blocks} blocks;"
            " make the block counts add up to the number of blocks."
        )
    return ranges_from_sizes(sizes)


def check_block_counts(sizes: Sequence[Any], key: str = "") -> None:
    """Raise unless every entry of an explicit balance is a positive integer. ``key`` prefixes the setting's name in
    the message (``"strategy."`` under Hydra)."""
    if any(isinstance(size, bool) or not isinstance(size, int) or size < 1 for size in sizes):
        raise ValueError(
            f"{key}balance={list(sizes)} is invalid; block counts must be positive integers: every stage needs at"
            " least one block."
        )


def check_one_count_per_stage(
    sizes: Sequence[int], num_stages: int, key: str = "", num_stages_set: bool = False, virtual_stages: int = 1,
    schedule: str = "",
) -> None:
    """Raise unless an explicit balance has one entry per model chunk: per stage, or ``num_stages * virtual_stages``
    of them for a ``schedule`` that runs several chunks per stage. ``num_stages_set``: the count is the user's
    ``num_stages`` setting (named in the message) rather than the one resolved from the process count."""
    chunks = num_stages * virtual_stages
    if len(sizes) == chunks:
        return
    if virtual_stages == 1:
        stages = f"{key}num_stages={num_stages}" if num_stages_set else f"there are {num_stages} stages"
        raise ValueError(
            f"{key}balance={list(sizes)} has {len(sizes)} entries but {stages}; give one block count per stage."
        )
    example = ", ".join(["2"] * chunks)
    raise ValueError(
        f"{key}balance={list(sizes)} has {len(sizes)} entries but {key}schedule={schedule!r} cuts the pipelined"
        f" blocks into {key}num_stages * {key}virtual_stages = {num_stages} * {virtual_stages} = {chunks} model"
        f" chunks; give one block count per chunk, in model order (e.g. {key}balance=[{example}])."
    )


# ---- balancing by a cost per block -----------------------------------------------------------------------------------


def min_max_partition(costs: Sequence[float], num_stages: int) -> list[int]:
    """Blocks per stage of the contiguous split of ``costs`` into ``num_stages`` non-empty stages whose most
    expensive stage is cheapest.

    ``best[s][i]``, the cheapest most-expensive stage when the first ``i`` blocks form ``s`` stages, is the minimum
    over the last stage's start ``j`` of ``max(best[s-1][j], cost of blocks j..i-1)``. The first term grows with
    ``j`` and the second shrinks, so the minimum sits where they cross: a binary search finds it, and the whole
    split takes ``O(num_stages * num_blocks * log(num_blocks))``.

    >>> min_max_partition([7, 7, 7, 7, 1, 1, 1, 1], 2)
    [2, 6]
    """
    costs = [float(c) for c in costs]
    num_blocks = len(costs)
    if num_stages < 1 or num_stages > num_blocks:
        raise ValueError(
            f"cannot split {num_blocks} blocks into {num_stages} non-empty stages; use between 1 and"
            f" {num_blocks} stages."
        )
    bad = [(i, c) for i, c in enumerate(costs) if not math.isfinite(c) or c < 0]
    if bad:
        raise ValueError(f"block costs must be finite and non-negative; block {bad[0][0]} costs {bad[0][1]}.")
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    # best[i] for the current stage count; start[s][i]: where the last of s stages starts in the best split.
    best = prefix[:]
    starts: list[list[int]] = [[0] * (num_blocks + 1)]
    for stages in range(2, num_stages + 1):
        current = [math.inf] * (num_blocks + 1)
        start = [0] * (num_blocks + 1)
        # The previous stages hold blocks 0..j-1 (at least stages - 1 of them); this stage holds j..i-1.
        previous = best
        for i in range(stages, num_blocks - (num_stages - stages) + 1):
            low, high = stages - 1, i - 1
            # First j in [low, high] where previous[j] >= prefix[i] - prefix[j]; previous[] is non-decreasing in j.
            j = _first_crossing(previous, prefix, i, low, high)
            for candidate in (j - 1, j):
                if low <= candidate <= high:
                    value = max(previous[candidate], prefix[i] - prefix[candidate])
                    if value < current[i]:
                        current[i], start[i] = value, candidate
        best = current
        starts.append(start)
    sizes, end = [], num_blocks
    for stages in range(num_stages, 0, -1):
        begin = starts[stages - 1][end] if stages > 1 else 0
        sizes.append(end - begin)
        end = begin
    return sizes[::-1]


def _first_crossing(previous: list[float], prefix: list[float], i: int, low: int, high: int) -> int:
    """The smallest ``j`` in ``[low, high]`` with ``previous[j] >= prefix[i] - prefix[j]`` (``high + 1`` if none)."""
    keys = range(low, high + 1)
    return low + bisect.bisect_left(keys, True, key=lambda j: previous[j] >= prefix[i] - prefix[j])


def stage_costs(costs: Sequence[float], ranges: Sequence[range]) -> list[float]:
    """The summed cost of every stage's blocks."""
    return [float(sum(costs[i] for i in block_range)) for block_range in ranges]


def imbalance(stage_totals: Sequence[float]) -> float:
    """The most expensive stage over the mean stage: 1.0 is perfect balance; a pipeline runs this much slower
    than a balanced one with the same total work (ignoring the bubble)."""
    mean = sum(stage_totals) / len(stage_totals)
    return max(stage_totals) / mean if mean > 0 else 1.0


def charged(
    costs: Sequence[float], unit: str, charges: Sequence[tuple[int, nn.Module]], block_parameters: Sequence[int] = ()
) -> list[float]:
    """``costs`` with each module of ``charges`` added to the block whose stage holds it (the embedding to the first
    block, the head and the loss to the last), in the same unit: its parameters, its parameter bytes, or for
    seconds its parameters at the blocks' seconds per parameter (``block_parameters``: each block's count; an
    embedding, a lookup, costs no time).
    torchtitan's ``first_stage_less_layers`` and ``last_stage_less_layers``, chosen by the costs themselves."""
    costs = [float(c) for c in costs]
    if unit not in ("parameters", "bytes", "seconds") or not charges:
        return costs
    seconds_per_parameter = sum(costs) / max(1, sum(block_parameters))
    for index, module in charges:
        parameters = list(module.parameters())
        if unit == "parameters":
            costs[index] += sum(p.numel() for p in parameters)
        elif unit == "bytes":
            costs[index] += sum(p.numel() * p.element_size() for p in parameters)
        else:
            computing = [m for m in module.modules() if not isinstance(m, nn.Embedding)]
            costs[index] += sum(p.numel() for m in computing for p in m.parameters(recurse=False)) * seconds_per_parameter
    return costs


# ---- the plan every rank applies -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockInfo:
    """What the summary shows of one block, known without running it."""

    type_name: str
    parameters: int
    parameter_bytes: int


@dataclass(frozen=True)
class PartitionPlan:
    """The split every rank applies, decided on one rank and broadcast.

    ``costs`` are the per-block costs the split minimised (``cost_unit`` says in what); ``profiles`` are the
    measurements behind them when the blocks were profiled.
    """

    method: str  # "explicit" (a list of block counts) or one of BALANCE_MODES
    ranges: list[range]
    blocks: list[BlockInfo]
    costs: list[float]
    cost_unit: str
    profiles: list[BlockProfile] | None = None


def recompute_fraction(mode: str, num_micro_batches: int) -> float:
    """The share of micro-batches whose forward runs again in backward under the re-computation ``mode`` (the
    public ``checkpoint`` option) in GPipe, as :func:`lightning_pipe.schedules.actions.with_recompute` decides it."""
    actions = SCHEDULES["gpipe"].stage_actions(0, 1, num_micro_batches, 1, mode)  # type: ignore[arg-type]
    return sum(a.recompute for a in actions if a.kind == "forward") / num_micro_batches


def needs_sample(balance: Balance) -> bool:
    """Whether ``balance`` profiles the blocks, which needs a sample input."""
    return isinstance(balance, str) and balance in PROFILED_MODES


def profiling_sample(balance: Balance, sample: Any, module: nn.Module) -> Any:
    """The input to profile the blocks with (:func:`~lightning_pipe.partition.profiling.profiling_input`):
    ``sample``, else ``module``'s ``example_input_array``, else during a fit the first training batch. Raises, naming
    the fix, when ``balance`` profiles and there is none."""
    if needs_sample(balance):
        sample = profiling_input(sample, module)
    elif sample is None:
        sample = getattr(module, "example_input_array", None)
    if sample is None and needs_sample(balance):
        raise ValueError(
            f"balance={balance!r} profiles every block on a sample input, but there is none: GPipeStrategy got no"
            " sample, the LightningModule has no example_input_array, and there is no first training batch to"
            " profile on (outside a fit, or a DataLoader that cannot be read at set-up); set"
            " `self.example_input_array = <one batch of forward's input>` in the module's __init__, or pass"
            " GPipeStrategy(sample=<one batch>), or use balance='parameters' or a list of blocks per stage."
        )
    return sample


def plan_partition(
    module: nn.Module,
    sequential: nn.Sequential,
    config: PipelineParallelConfig,
    balance: Balance,
    sample: Any = None,
    device: torch.device | None = None,
    recompute_fraction: float = 0.0,
    charges: Sequence[tuple[int, nn.Module]] = (),
    step: Callable[[nn.Module], Any] | None = None,
    loss_per_micro_batch: bool = False,
    state_layout: StateLayout = StateLayout(),
) -> PartitionPlan:
    """The split of ``sequential``'s blocks for ``balance``; ``charges``: modules outside the blocks that the stage
    of a block holds (see :func:`charged`).

    ``None`` and ``"uniform"`` split the blocks evenly; a list gives blocks per stage; ``"parameters"`` balances
    parameter counts; ``"time"`` and ``"memory"`` profile every block on ``device`` with ``sample`` (an input of
    ``module``'s forward; by default its ``example_input_array``, else during a fit the first training batch: see
    :func:`profiling_sample`) and balance forward-plus-backward time (the forward
    counted ``1 + recompute_fraction`` times, as re-computation repeats it) or parameter-plus-activation bytes.

    ``"memory"`` on blocks built on the meta device (no weights to profile) estimates instead
    (:mod:`lightning_pipe.partition.memory_estimate`): state from the parameters' shapes, activations from
    ``step(module)`` (the training step on the first batch's shapes; else ``module``'s forward on ``sample``) run on
    the meta device, the loss's held for the whole batch, or one micro-batch with ``loss_per_micro_batch``; the
    blocks' state held as ``state_layout`` says (sharded over a stage's replicas with ``data_parallel="shard"``).
    ``"parameters"`` and ``"memory"`` count what one rank holds: with tensor parallelism, ``1/T`` of the layers the
    plan splits (``state_layout.rank_elements``), the rest of the block and the outside modules whole.
    """
    blocks = [
        BlockInfo(
            type(block).__name__,
            sum(p.numel() for p in block.parameters()),
            sum(p.numel() * p.element_size() for p in block.parameters()),
        )
        for block in sequential
    ]
    num_blocks = len(blocks)
    if balance is None or balance == "uniform":
        ranges = split_evenly(num_blocks, config.num_stages)
        return PartitionPlan("uniform", ranges, blocks, [1.0] * num_blocks, "blocks")
    if not isinstance(balance, str):
        ranges = stage_ranges(config, num_blocks, balance)
        return PartitionPlan("explicit", ranges, blocks, [1.0] * num_blocks, "blocks")
    check_stage_count(num_blocks, config.num_stages)
    profiles = None
    if balance == "memory" and any(t.is_meta for t in (*sequential.parameters(), *sequential.buffers())):
        calling = step if step is not None else None if sample is None else partial(_forward_on_meta, sample)
        estimated = estimate_block_memory(module, list(sequential), calling, charges, state_layout)
        micro_batches = config.num_micro_batches
        outside_share = 1 / micro_batches if loss_per_micro_batch else 1.0  # the loss on the whole batch, or on one
        costs = memory_costs(estimated, held_micro_batches(micro_batches, recompute_fraction), outside_share)
        unit = "bytes"
    elif balance == "parameters":  # a rank's: with tensor parallelism, its slice of the split layers
        held = [float(sum(state_layout.elements(p) for p in block.parameters())) for block in sequential]
        costs = charged(held, "parameters", charges)
        unit = "parameters"
    else:
        profiles = profile_blocks(
            sequential,
            pipelined_input(module, sequential, profiling_sample(balance, sample, module)),
            device or torch.device("cpu"),
            config.num_micro_batches,
        )
        if balance == "time":
            costs = [p.forward_seconds * (1 + recompute_fraction) + p.backward_seconds for p in profiles]
            unit = "seconds"
        else:
            costs, unit = [float(p.memory_bytes) for p in profiles], "bytes"
        costs = charged(costs, unit, charges, [block.parameters for block in blocks])
    if sum(costs) > 0:
        ranges = ranges_from_sizes(min_max_partition(costs, config.num_stages))
    else:  # nothing to balance (e.g. no block has parameters): fall back to an even split
        ranges = split_evenly(num_blocks, config.num_stages)
    return PartitionPlan(balance, ranges, blocks, costs, unit, profiles)


def _forward_on_meta(sample: Any, module: nn.Module) -> Any:
    """``module``'s forward on ``sample`` moved to the meta device (a tuple: positional arguments; a dict: keyword
    arguments)."""
    sample = move_data_to_device(sample, torch.device("meta"))
    if isinstance(sample, tuple):
        return module(*sample)
    return module(**sample) if isinstance(sample, dict) else module(sample)
