"""Faults injected into a pipelined run on purpose, to show that a comparison with one device can fail."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor

from lightning_pipe.execution import inboxes


def drop_gradient_of(micro_batch: int) -> Callable[[], None]:
    """Every stage that receives gradients takes zeros instead of one micro-batch's; returns what undoes it."""
    original = inboxes.GradientInbox.take

    def take(self, k, m, micro_batches):
        grads = original(self, k, m, micro_batches)
        return tuple(torch.zeros_like(g) for g in grads) if m == micro_batch else grads

    inboxes.GradientInbox.take = take
    return lambda: setattr(inboxes.GradientInbox, "take", original)


def clip_one_ulp_apart() -> Callable[[], None]:
    """Every rank but global rank 0 clips by a gradient norm one float32 ulp larger (the drift that a norm summed in
    another order on one rank causes); returns what undoes it."""
    original = torch.nn.utils.clip_grads_with_norm_

    def clip(parameters, max_norm, total_norm, *args, **kwargs):
        if torch.distributed.get_rank() != 0:
            single = total_norm.float()
            total_norm = torch.nextafter(single, torch.full_like(single, float("inf"))).to(total_norm.dtype)
        return original(parameters, max_norm, total_norm, *args, **kwargs)

    torch.nn.utils.clip_grads_with_norm_ = clip
    return lambda: setattr(torch.nn.utils, "clip_grads_with_norm_", original)


def leave_outside_gradients_unsummed() -> Callable[[], None]:
    """The stages holding a parameter outside the blocks (GPT-2's embedding, tied to its head on the loss stage) keep
    their own part of its gradient instead of the sum; returns what undoes it."""
    from lightning_pipe.execution.outside import OutsideOwnership

    original = OutsideOwnership.sum_gradients
    OutsideOwnership.sum_gradients = lambda self, watchdog=None: None
    return lambda: setattr(OutsideOwnership, "sum_gradients", original)


def answer_stand_ins_without_gradients() -> Callable[[], None]:
    """The stand-ins of what a stage does not hold (another stage's blocks and outside modules) answer tensors that need
    no gradient, as before the fix of issue #43: a reentrant checkpoint around a later block then computes that block's
    chunk without gradients. Returns what undoes it."""
    from lightning_pipe.execution import placeholders

    original = placeholders.wants_gradients
    placeholders.wants_gradients = lambda module, args, kwargs: False
    return lambda: setattr(placeholders, "wants_gradients", original)


def reduce_scatter_without_averaging() -> Callable[[], None]:
    """The gradients of blocks sharded over the replicas (``data_parallel="shard"``) are reduce-scattered as the sum
    over the replicas, not their average; returns what undoes it."""
    from lightning_pipe.execution.sharding import StageSharding

    original = StageSharding.reduce_scatter_gradients

    def summed(self):
        original(self)
        replicas = torch.distributed.get_world_size(self.group)
        for block in self.blocks:  # the average times the replica count (gloo has no pre-multiplied sum)
            for parameter in block.parameters():
                if isinstance(parameter.grad, DTensor):  # a shard's gradient (a tied weight stays whole)
                    parameter.grad.to_local().mul_(replicas)

    StageSharding.reduce_scatter_gradients = summed
    return lambda: setattr(StageSharding, "reduce_scatter_gradients", original)


def record_clipping_norms(norms: list[str]) -> Callable[[], None]:
    """Append every total norm that clipping scales by (``clip_grads_with_norm_``'s), as the exact hex of its float,
    to ``norms``; returns what undoes it."""
    original = torch.nn.utils.clip_grads_with_norm_

    def clip(parameters, max_norm, total_norm, *args, **kwargs):
        norms.append(float(total_norm).hex())
        return original(parameters, max_norm, total_norm, *args, **kwargs)

    torch.nn.utils.clip_grads_with_norm_ = clip
    return lambda: setattr(torch.nn.utils, "clip_grads_with_norm_", original)


def count_every_slice_on_every_rank() -> Callable[[], None]:
    """The gradient norm counts each tensor-parallel slice's squares on every rank holding it (a row-wise layer's bias,
    whole on each tensor-parallel rank, counted T times), not once; returns what undoes it."""
    from lightning_pipe.execution import gradients

    original = gradients._split_squared_norm
    gradients._split_squared_norm = lambda grads, device, holders: gradients.local_squared_norm(grads, device)
    return lambda: setattr(gradients, "_split_squared_norm", original)
