"""Splitting a stage input into micro-batches along dim 0, and joining micro-batch outputs back."""

from __future__ import annotations

from typing import Any, Union

import torch
from torch import Tensor

# What flows between stages: one tensor, or a tuple of tensors (an nn.Sequential passes either from layer to layer).
Activation = Union[Tensor, tuple[Tensor, ...]]


def as_tensors(value: object, where: str) -> tuple[Tensor, ...]:
    """The tensors of an activation, or a ``TypeError`` saying what else was found ``where``."""
    tensors = value if isinstance(value, tuple) else (value,)
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, Tensor):
            raise TypeError(
                f"{where} is a {type(tensor).__name__} (item {index}); only a tensor or a tuple of tensors can flow"
                " between pipeline stages. Return tensors from the pipelined layers and keep other values outside"
                " the nn.Sequential."
            )
    return tensors


def batch_size(value: Activation, where: str) -> int:
    """The common size of dim 0 of every tensor in ``value``."""
    sizes = {tensor.shape[0] if tensor.dim() else None for tensor in as_tensors(value, where)}
    if None in sizes or len(sizes) != 1:
        raise ValueError(
            f"{where} must hold tensors with one common batch dimension (dim 0) to be split into micro-batches;"
            f" found sizes {sorted(sizes, key=str)}."
        )
    return sizes.pop()  # type: ignore[return-value]


def check_batch_kept(inputs: tuple[Tensor, ...], outputs: tuple[Tensor, ...], stage: int, micro_batch: int) -> None:
    """Raise unless every output of a stage keeps its input's batch dimension (dim 0).

    The last stage joins the micro-batch outputs along dim 0: a stage that reduces or reshapes over the batch would
    hand the user's loss another batch than one device computes (or fail far from the cause).
    """
    size = inputs[0].shape[0]
    for index, tensor in enumerate(outputs):
        if tensor.dim() == 0 or tensor.shape[0] != size:
            raise ValueError(
                f"pipeline stage {stage} turned micro-batch {micro_batch} of {size} samples into an output whose item"
                f" {index} has shape {tuple(tensor.shape)}; the pipeline joins the stages' outputs along dim 0, so"
                " every stage must keep the batch dimension first, one row per sample. Move the reduction or reshape"
                " over the batch after the pipelined nn.Sequential, or keep dim 0 (e.g. nn.Flatten(start_dim=1))."
            )


def split(value: Activation, num_micro_batches: int) -> list[Activation]:
    """Split along dim 0 into ``min(num_micro_batches, batch size)`` non-empty chunks whose sizes differ by at most 1.

    The chunks are views: no data is copied.
    """
    size = batch_size(value, "the input of the pipelined module")
    chunks = max(1, min(num_micro_batches, size))
    if isinstance(value, Tensor):
        return list(torch.tensor_split(value, chunks))
    per_tensor = [torch.tensor_split(tensor, chunks) for tensor in value]
    return [tuple(parts) for parts in zip(*per_tensor)]


def join(outputs: list[Any]) -> Any:
    """Concatenate micro-batch outputs along dim 0: the output one device would have computed on the whole batch.

    Tensors are concatenated; tuples, lists and ``ModelOutput``-like mappings are joined item by item; ``None``
    stays ``None``; any other object (a cache) is the first micro-batch's.
    """
    first = outputs[0]
    if isinstance(first, Tensor):
        if first.dim() == 0:
            raise ValueError(
                "a pipelined block returned a 0-dimensional tensor, which cannot be joined over micro-batches; return"
                " values with the batch dimension first from the pipelined blocks."
            )
        return torch.cat(outputs) if len(outputs) > 1 else first
    if first is None:
        return None
    if hasattr(first, "to_tuple") and hasattr(first, "keys"):  # a Hugging Face ModelOutput
        return type(first)(**{key: join([output[key] for output in outputs]) for key in first.keys()})
    if isinstance(first, (tuple, list)) and not hasattr(first, "_fields"):
        return type(first)(join(list(parts)) for parts in zip(*outputs))
    return first
