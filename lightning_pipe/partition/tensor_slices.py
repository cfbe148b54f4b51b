"""What one tensor-parallel rank holds of a block: each parameter of a layer the plan splits by its slice, the rest
whole. Known from the plan and the shapes alone (the meta device will do), for the balance, the memory estimate and
the start-up table.

A column-wise split cuts a linear layer's weight and bias along their output dimension (0), a row-wise split its
weight along the input dimension (1) and leaves its bias whole; for an embedding, column-wise cuts the embedding
dimension (1), row-wise the rows (0). A split ``configure_model`` made itself says its dimensions in its
placements. Each rank holds ``ceil(n / T)`` of a split dimension of ``n`` at most, as DTensor's ``Shard`` deals it.
A style of the user's own (a function plan, ``SequenceParallel``) is counted whole: what it splits is not known
before it runs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel


def split_dimension(module: nn.Module, parameter: str, style: Any) -> int | None:
    """The dimension of ``module``'s ``parameter`` that ``style`` (a plan's string, a torch ``ParallelStyle``, or a
    split taken from ``configure_model``, with its ``layouts``) splits over the tensor-parallel ranks; ``None``
    where the parameter stays whole."""
    layouts = getattr(style, "layouts", None)
    if isinstance(layouts, Mapping):  # configure_model's own split: its placements say
        placements = layouts.get(parameter, (None, ()))[1]
        return next((p.dim for p in placements if isinstance(p, Shard)), None)
    column = (isinstance(style, str) and style.startswith("colwise")) or isinstance(style, ColwiseParallel)
    row = (isinstance(style, str) and style.startswith("rowwise")) or isinstance(style, RowwiseParallel)
    if isinstance(module, nn.Embedding) and parameter == "weight":
        return 1 if column else 0 if row else None
    if not isinstance(module, nn.Linear):
        return None
    if column:
        return 0
    return 1 if row and parameter == "weight" else None


def slice_shape(shape: Sequence[int], dimension: int | None, size: int) -> tuple[int, ...]:
    """The shape of the largest of ``size`` slices of a tensor of ``shape`` split along ``dimension`` (``None``:
    whole).

    >>> slice_shape((96, 64), 0, 2), slice_shape((64, 96), 1, 4), slice_shape((5,), 0, 2), slice_shape((8,), None, 2)
    ((48, 64), (64, 24), (3,), (8,))
    """
    if dimension is None or size == 1:
        return tuple(shape)
    return tuple(-(-n // size) if d == dimension else n for d, n in enumerate(shape))


def rank_slice_shapes(block: nn.Module, styles: Mapping[str, Any], size: int) -> dict[str, tuple[int, ...]]:
    """The shape one of ``size`` tensor-parallel ranks holds of each parameter of ``block`` (by name in the block)
    that ``styles`` (the block's plan: module name in the block to style) splits; the others are held whole."""
    shapes: dict[str, tuple[int, ...]] = {}
    for name, style in styles.items():
        module = block.get_submodule(name)
        for parameter, tensor in module.named_parameters(recurse=False):
            dimension = split_dimension(module, parameter, style)
            if dimension is not None:
                shapes[f"{name}.{parameter}" if name else parameter] = slice_shape(tensor.shape, dimension, size)
    return shapes
