"""Splitting a stage input into micro-batches along dim 0, and joining micro-batch outputs back."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Union

import torch
from torch import Tensor

# What flows between stages: one tensor, or a tuple of tensors (an nn.Sequential passes either from block to block).
Activation = Union[Tensor, tuple[Tensor, ...]]


def as_tensors(value: object, where: str) -> tuple[Tensor, ...]:
    """The tensors of an activation, or a ``TypeError`` saying what else was found ``where``."""
    tensors = value if isinstance(value, tuple) else (value,)
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, Tensor):
            raise TypeError(
                f"{where} is a {type(tensor).__name__} (item {index}); only a tensor or a tuple of tensors can flow"
                " between pipeline stages. Return tensors from the pipelined blocks and keep other values outside"
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


def split_batch(batch: Any, num_micro_batches: int) -> list[Any]:
    """A training batch as Lightning hands it to ``training_step`` (tensors, or tuples, lists and dicts of them),
    split into ``min(num_micro_batches, batch size)`` micro-batches of the same structure: every tensor whose dim 0
    is the batch size is split along it (sizes differ by at most 1), everything else is passed to each whole."""
    size = batch_size_of(batch)
    parts = max(1, min(num_micro_batches, size))
    pieces: list[list[Tensor]] = []

    def take(tensor: Tensor) -> Tensor:
        if tensor.dim() and tensor.shape[0] == size:
            pieces.append(list(torch.tensor_split(tensor, parts)))
            return tensor
        pieces.append([tensor] * parts)
        return tensor

    map_tensors(batch, take)
    return [_rebuilt(batch, iter([piece[i] for piece in pieces])) for i in range(parts)]


def batch_size_of(batch: Any) -> int:
    """The batch size of a training batch: dim 0 of its first tensor with one (as Lightning reads it)."""
    sizes: list[int] = []
    map_tensors(batch, lambda tensor: sizes.append(tensor.shape[0]) if tensor.dim() else None)
    if not sizes:
        raise ValueError(
            "the training batch holds no tensor with a batch dimension, so it cannot be split into micro-batches;"
            " return tensors with the batch first from the DataLoader, or use schedule='gpipe', which splits only"
            " the input of the pipelined blocks."
        )
    return sizes[0]


def _rebuilt(structure: Any, tensors: Iterator[Tensor]) -> Any:
    """``structure`` with its tensors, in :func:`map_tensors`' order, replaced by the next of ``tensors``."""
    return map_tensors(structure, lambda _: next(tensors))


def map_tensors(value: Any, function: Callable[[Tensor], Any]) -> Any:
    """``value`` with ``function`` applied to every tensor in it, through the structures :func:`join` joins."""
    if isinstance(value, Tensor):
        return function(value)
    if hasattr(value, "to_tuple") and hasattr(value, "keys"):  # a Hugging Face ModelOutput
        return type(value)(**{key: map_tensors(value[key], function) for key in value.keys()})
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return type(value)(map_tensors(item, function) for item in value)
    if isinstance(value, Mapping):  # a dict, or a mapping type that builds from one (a tokenizer's BatchEncoding)
        items = {key: map_tensors(item, function) for key, item in value.items()}
        return items if type(value) is dict else type(value)(items)
    return value


def join(outputs: list[Any], alias: bool = False) -> Any:
    """Concatenate micro-batch outputs along dim 0: the output one device would have computed on the whole batch.

    Tensors are concatenated; tuples, lists and ``ModelOutput``-like mappings are joined item by item; ``None``
    stays ``None``; any other object (a cache) is the first micro-batch's. With ``alias``, each micro-batch's tensor
    that is an autograd leaf becomes a view of its rows of the joined one, so that the batch's output is held once:
    the leaves' values are not read again, their gradients only accumulate there.
    """
    first = outputs[0]
    if isinstance(first, Tensor):
        if first.dim() == 0:
            raise ValueError(
                "a pipelined block returned a 0-dimensional tensor, which cannot be joined over micro-batches; return"
                " values with the batch dimension first from the pipelined blocks."
            )
        if len(outputs) == 1:
            return first
        joined = torch.cat(outputs)
        if alias:
            for part, rows in zip(outputs, torch.split(joined.detach(), [part.shape[0] for part in outputs])):
                if part.is_leaf and part.requires_grad:
                    part.data = rows
        return joined
    if first is None:
        return None
    if hasattr(first, "to_tuple") and hasattr(first, "keys"):  # a Hugging Face ModelOutput
        return type(first)(**{key: join([output[key] for output in outputs], alias) for key in first.keys()})
    if isinstance(first, (tuple, list)) and not hasattr(first, "_fields"):
        return type(first)(join(list(parts), alias) for parts in zip(*outputs))
    return first
