"""Faults injected into a pipelined run on purpose, to show that a comparison with one device can fail."""

from __future__ import annotations

from collections.abc import Callable

import torch

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
    from lightning_pipe.execution import block_calls, outside

    originals = block_calls.needing_gradients_as_real, outside.needing_gradients_as_real
    unchanged = lambda output, module, args, kwargs: output  # noqa: E731
    block_calls.needing_gradients_as_real = outside.needing_gradients_as_real = unchanged

    def undo() -> None:
        block_calls.needing_gradients_as_real, outside.needing_gradients_as_real = originals

    return undo
