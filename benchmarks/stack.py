"""The benchmark model and data, built identically in every process from a :class:`Workload`."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from workload import Workload


def make_stack(work: Workload) -> nn.Sequential:
    """The whole model, with the same weights in every process (each stage keeps its own slice)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(work.depth):
        layers += [nn.Linear(work.width, work.width), nn.ReLU()]
    return nn.Sequential(*layers)


def make_batch(work: Workload) -> tuple[Tensor, Tensor]:
    """An input batch and a regression target, the same in every process."""
    generator = torch.Generator().manual_seed(1)
    return (
        torch.randn(work.batch, work.width, generator=generator),
        torch.randn(work.batch, work.width, generator=generator),
    )
