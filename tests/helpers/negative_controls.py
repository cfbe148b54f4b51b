"""Faults injected into a pipelined run on purpose, to show that a comparison with one device can fail."""

from __future__ import annotations

from collections.abc import Callable

import torch

from lightning_pipe import engine


def drop_gradient_of(micro_batch: int) -> Callable[[], None]:
    """The last stage sends zeros instead of one micro-batch's input gradient; returns what undoes it."""
    original = engine._OrderedGradientSender._ready

    def ready(self, m, grads):
        if m == micro_batch:
            grads = tuple(torch.zeros_like(g) if g is not None else None for g in grads)
        original(self, m, grads)

    engine._OrderedGradientSender._ready = ready
    return lambda: setattr(engine._OrderedGradientSender, "_ready", original)
