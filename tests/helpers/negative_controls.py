"""Faults injected into a pipelined run on purpose, to show that a comparison with one device can fail."""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_pipe import engine


def drop_gradient_of(micro_batch: int) -> Callable[[], None]:
    """Every stage that receives gradients takes zeros instead of one micro-batch's; returns what undoes it."""
    original = engine._GradientInbox.take

    def take(self, k, m, micro_batches):
        grads = original(self, k, m, micro_batches)
        return tuple(torch.zeros_like(g) for g in grads) if m == micro_batch else grads

    engine._GradientInbox.take = take
    return lambda: setattr(engine._GradientInbox, "take", original)
