"""Where each chunk's autograd graph begins and ends: its inputs as leaves, its output cut where the user's loss
lands, and the gradients that stopped at a call's leaves carried on into the model's own code."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, get_gradient_edge

from lightning_pipe.execution.call_order import ChunkCall
from lightning_pipe.partition import microbatch

WHERE_INPUT = "the input of the pipelined module"


def input_leaf(tensor: Tensor, requires_grad: bool) -> Tensor:
    """A chunk input as an autograd leaf, so that each micro-batch's backward stops at the chunk boundary."""
    detached = tensor.detach()
    if requires_grad and detached.is_floating_point():
        detached.requires_grad_(True)
    return detached


def grad_or_zeros(tensor: Tensor) -> Tensor:
    """The gradient a leaf received, or zeros where backward reached it with none (a micro-batch's loss that does not
    depend on it)."""
    return tensor.grad if tensor.grad is not None else torch.zeros_like(tensor)


def cut_output(out: Any, grad: bool, every_float: bool = False) -> tuple[Any, tuple[Tensor, ...], tuple[Tensor, ...]]:
    """The last chunk's output as the user's code gets it when training: every tensor that needs a gradient (with
    ``every_float``, every floating-point one) replaced by a leaf that needs one, so that the user's loss ends there
    and each micro-batch's backward starts there; with the original tensors and the leaves, in the same order."""
    originals: list[Tensor] = []
    leaves: list[Tensor] = []

    def cut(tensor: Tensor) -> Tensor:
        if not (grad and tensor.is_floating_point() and (tensor.requires_grad or every_float)):
            return tensor
        leaf = tensor.detach().requires_grad_(True)
        originals.append(tensor)
        leaves.append(leaf)
        return leaf

    return microbatch.map_tensors(out, cut), tuple(originals), tuple(leaves)


def gradient_edges(tensors: Iterable[Tensor]) -> tuple[GradientEdge | None, ...]:
    """Where each tensor's gradient enters the graph (``None`` for one that needs none)."""
    return tuple(get_gradient_edge(t) if t.requires_grad else None for t in tensors)


@dataclass
class CallState:
    """One call of a chunk by the model's code in this step: its micro-batches' inputs, and how many are done."""

    call: ChunkCall
    forwarded: dict[int, tuple[Tensor, ...]] = field(default_factory=dict)  # part of the call -> its input leaves
    back_propagated: int = 0


def backward_into_user_graph(state: CallState) -> None:
    """Carry the gradients that stopped at a call's leaves into the model's code, in one backward: the first chunk's
    input (joined over the micro-batches) and every side argument (masks, position embeddings, an encoder's output)
    that the model's code before the blocks computed."""
    targets, grads = [], []
    parts = [state.forwarded[m] for m in sorted(state.forwarded)]
    if state.call.chunk == 0:
        for i, original in enumerate(microbatch.as_tensors(state.call.stage_input, WHERE_INPUT)):
            if original.requires_grad:
                pieces = [grad_or_zeros(inputs[i]) for inputs in parts]
                targets.append(original)
                grads.append(torch.cat(pieces) if len(pieces) > 1 else pieces[0])
    for original, grad in state.call.side_gradients():
        targets.append(original)
        grads.append(grad)
    if targets:
        torch.autograd.backward(targets, grads)
