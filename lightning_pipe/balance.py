"""Balancing: which contiguous layers each stage gets, so that the slowest (or fullest) stage costs the least.

A pipeline runs at the pace of its most expensive stage. Given a cost per layer (1 per layer, its parameter count,
its profiled time or memory), :func:`min_max_partition` returns the contiguous split whose most expensive stage is
as cheap as possible: exactly, by dynamic programming, not by a greedy fill. :func:`plan_partition` turns a
``balance=`` choice into that split, profiling the layers when the choice asks for it.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args

import torch
from torch import nn

from lightning_pipe.config import PipelineParallelConfig, ranges_from_sizes
from lightning_pipe.partition import stage_ranges
from lightning_pipe.profile import LayerProfile, pipelined_input, profile_layers

BalanceMode = Literal["uniform", "parameters", "time", "memory"]
BALANCE_MODES: tuple[str, ...] = get_args(BalanceMode)
PROFILED_MODES = ("time", "memory")

Balance = Union[Sequence[int], BalanceMode, None]


def min_max_partition(costs: Sequence[float], num_stages: int) -> list[int]:
    """Layers per stage of the contiguous split of ``costs`` into ``num_stages`` non-empty stages whose most
    expensive stage is cheapest.

    ``best[s][i]``, the cheapest most-expensive stage when the first ``i`` layers form ``s`` stages, is the minimum
    over the last stage's start ``j`` of ``max(best[s-1][j], cost of layers j..i-1)``. The first term grows with
    ``j`` and the second shrinks, so the minimum sits where they cross: a binary search finds it, and the whole
    split takes ``O(num_stages * num_layers * log(num_layers))``.

    >>> min_max_partition([7, 7, 7, 7, 1, 1, 1, 1], 2)
    [2, 6]
    """
    costs = [float(c) for c in costs]
    num_layers = len(costs)
    if num_stages < 1 or num_stages > num_layers:
        raise ValueError(
            f"cannot split {num_layers} layers into {num_stages} non-empty stages; use between 1 and"
            f" {num_layers} stages."
        )
    bad = [(i, c) for i, c in enumerate(costs) if not math.isfinite(c) or c < 0]
    if bad:
        raise ValueError(f"layer costs must be finite and non-negative; layer {bad[0][0]} costs {bad[0][1]}.")
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    # best[i] for the current stage count; start[s][i]: where the last of s stages starts in the best split.
    best = prefix[:]
    starts: list[list[int]] = [[0] * (num_layers + 1)]
    for stages in range(2, num_stages + 1):
        current = [math.inf] * (num_layers + 1)
        start = [0] * (num_layers + 1)
        # The previous stages hold layers 0..j-1 (at least stages - 1 of them); this stage holds j..i-1.
        previous = best
        for i in range(stages, num_layers - (num_stages - stages) + 1):
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
    sizes, end = [], num_layers
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
    """The summed cost of every stage's layers."""
    return [float(sum(costs[i] for i in layer_range)) for layer_range in ranges]


def imbalance(stage_totals: Sequence[float]) -> float:
    """The most expensive stage over the mean stage: 1.0 is perfect balance; a pipeline runs this much slower
    than a balanced one with the same total work (ignoring the bubble)."""
    mean = sum(stage_totals) / len(stage_totals)
    return max(stage_totals) / mean if mean > 0 else 1.0


@dataclass(frozen=True)
class LayerInfo:
    """What the summary shows of one layer, known without running it."""

    type_name: str
    parameters: int
    parameter_bytes: int


@dataclass(frozen=True)
class PartitionPlan:
    """The split every rank applies, decided on one rank and broadcast.

    ``costs`` are the per-layer costs the split minimised (``cost_unit`` says in what); ``profiles`` are the
    measurements behind them when the layers were profiled.
    """

    method: str  # "explicit" (a list of layer counts) or one of BALANCE_MODES
    ranges: list[range]
    layers: list[LayerInfo]
    costs: list[float]
    cost_unit: str
    profiles: list[LayerProfile] | None = None


def validate_balance(balance: Any) -> list[int] | BalanceMode | None:
    """``balance`` as the strategy keeps it, or a ``ValueError`` naming the accepted forms."""
    if balance is None or isinstance(balance, str):
        if balance is not None and balance not in BALANCE_MODES:
            raise ValueError(
                f"balance={balance!r} is not a balancing mode; use one of {', '.join(map(repr, BALANCE_MODES))},"
                " or a list of layers per stage such as [3, 5]."
            )
        return balance  # type: ignore[return-value]
    return list(balance)


def recompute_fraction(checkpoint: str, num_micro_batches: int) -> float:
    """The share of micro-batches whose forward runs again in backward under the activation-checkpoint mode."""
    if checkpoint == "always":
        return 1.0
    if checkpoint == "except_last":
        return (num_micro_batches - 1) / num_micro_batches
    return 0.0


def needs_sample(balance: Balance) -> bool:
    """Whether ``balance`` profiles the layers, which needs a sample input."""
    return isinstance(balance, str) and balance in PROFILED_MODES


def plan_partition(
    module: nn.Module,
    sequential: nn.Sequential,
    config: PipelineParallelConfig,
    balance: Balance,
    sample: Any = None,
    device: torch.device | None = None,
    recompute_fraction: float = 0.0,
) -> PartitionPlan:
    """The split of ``sequential``'s layers for ``balance``.

    ``None`` and ``"uniform"`` split the layers evenly (as :meth:`PipelineParallelConfig.split_into_stages`); a list
    gives layers per stage; ``"parameters"`` balances parameter counts; ``"time"`` and ``"memory"`` profile every
    layer on ``device`` with ``sample`` (an input of ``module``'s forward) and balance forward-plus-backward time
    (the forward counted ``1 + recompute_fraction`` times, as re-computation repeats it) or parameter-plus-activation
    bytes.
    """
    layers = [
        LayerInfo(
            type(layer).__name__,
            sum(p.numel() for p in layer.parameters()),
            sum(p.numel() * p.element_size() for p in layer.parameters()),
        )
        for layer in sequential
    ]
    num_layers = len(layers)
    if balance is None or balance == "uniform" or not isinstance(balance, str):
        ranges = stage_ranges(config, num_layers, None if isinstance(balance, str) else balance)
        method = "explicit" if balance is not None and not isinstance(balance, str) else "uniform"
        return PartitionPlan(method, ranges, layers, [1.0] * num_layers, "layers")
    if config.num_stages > num_layers:
        config.split_into_stages(num_layers)  # raises the error that names the fix
    profiles = None
    if balance == "parameters":
        costs, unit = [float(layer.parameters) for layer in layers], "parameters"
    else:
        if sample is None:
            raise ValueError(missing_sample_message(balance))
        profiles = profile_layers(
            sequential,
            pipelined_input(module, sequential, sample),
            device or torch.device("cpu"),
            config.num_micro_batches,
        )
        if balance == "time":
            costs = [p.forward_seconds * (1 + recompute_fraction) + p.backward_seconds for p in profiles]
            unit = "seconds"
        else:
            costs, unit = [float(p.memory_bytes) for p in profiles], "bytes"
    if sum(costs) > 0:
        ranges = ranges_from_sizes(min_max_partition(costs, config.num_stages))
    else:  # nothing to balance (e.g. no layer has parameters): fall back to an even split
        ranges = config.split_into_stages(num_layers)
    return PartitionPlan(balance, ranges, layers, costs, unit, profiles)


def missing_sample_message(balance: str) -> str:
    return (
        f"balance={balance!r} profiles every layer on a sample input, but the LightningModule has no"
        " example_input_array and GPipeStrategy got no sample; set `self.example_input_array = <one batch of"
        " forward's input>` in the module's __init__, or pass GPipeStrategy(sample=<one batch>), or use"
        " balance='parameters' or a list of layers per stage."
    )
