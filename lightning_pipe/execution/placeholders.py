"""A block's output computed on the meta device: what the model's code gets for a block that runs elsewhere or later."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipe.execution.call_order import map_tensors
from lightning_pipe.partition.hooks import hooks_set_aside

SIGNATURES_KEPT = 8
_PLAIN = (bool, int, float, str, torch.dtype, torch.device, type(None))


class Placeholders:
    """The meta-device outputs of the region's blocks (``originals``), each block run there once per input signature.

    ``running_blocks`` is the stage's context in which a block's call runs the block itself, not its stand-in.
    """

    def __init__(
        self, originals: list[nn.Module], running_blocks: Callable[[], contextlib.AbstractContextManager]
    ) -> None:
        self.originals = originals
        self._running_blocks = running_blocks
        self._meta_states: dict[int, dict[str, Tensor]] = {}
        self._meta_outputs: dict[int, dict[Hashable, Any]] = {}  # per block: its meta output, by input signature

    def output(self, index: int, args: tuple, kwargs: dict, reuse: bool = True) -> Any:
        """The block's output on the meta device: its structure and shapes, without its cost.

        The block runs there once per input signature (training mode, the arguments' shapes, strides and dtypes,
        their plain values); later calls with the same signature get fresh meta tensors shaped as that output. An
        argument or output that holds anything else (an object, a named tuple) makes the block run every time.
        """
        block = self.originals[index]
        known = self._meta_outputs.setdefault(index, {})
        key = _signature_of_call(block.training, args, kwargs) if reuse else None
        if key is not None and key in known:
            return map_tensors(known[key], fresh_meta)
        if index not in self._meta_states:
            self._meta_states[index] = {
                name: torch.empty_like(t, device="meta") for name, t in _state(block).items()
            }
        with self._running_blocks(), torch.no_grad(), hooks_set_aside(block.modules()):  # no user hook sees meta tensors
            output = torch.func.functional_call(
                block, self._meta_states[index], map_tensors(args, _to_meta), map_tensors(kwargs, _to_meta),
                strict=False,
            )
        if key is not None and signature(output) is not None:
            if len(known) >= SIGNATURES_KEPT:
                known.clear()  # signatures that change every step (a growing sequence) must not pile up
            known[key] = map_tensors(output, fresh_meta)
        return output


def fresh_meta(tensor: Tensor) -> Tensor:
    """A new meta tensor with ``tensor``'s shape, strides and dtype."""
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")


def _to_meta(tensor: Tensor) -> Tensor:
    return tensor if tensor.is_meta else tensor.to("meta")


def _signature_of_call(training: bool, args: tuple, kwargs: dict) -> Hashable | None:
    """:func:`signature` of a block call; for the common call on tensors alone, a flat key of their shapes, strides and
    dtypes (which no nested signature equals: it starts with a bool)."""
    if not kwargs and all(type(arg) is Tensor for arg in args):
        return (training, *[(arg.shape, arg.stride(), arg.dtype) for arg in args])
    return signature((training, args, kwargs))


def signature(value: Any) -> Hashable | None:
    """What a block's meta output can depend on in ``value``, as a hashable key: each tensor's shape, strides and
    dtype, plain values as they are, containers as ``map_tensors`` walks them; ``None`` if ``value`` holds anything
    else."""
    if isinstance(value, Tensor):
        return (value.shape, value.stride(), value.dtype)  # torch.Size is a tuple: hashable as it is
    if isinstance(value, _PLAIN):
        return (type(value).__name__, value)
    if (isinstance(value, (tuple, list)) and not hasattr(value, "_fields")) or type(value) is dict:
        keys = []
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            found = signature(item)
            if found is None:
                return None
            keys.append((key, found))
        return (type(value).__name__, tuple(keys))
    return None


def _state(block: nn.Module) -> dict[str, Tensor]:
    return {**dict(block.named_parameters()), **dict(block.named_buffers())}
