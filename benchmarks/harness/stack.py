"""The benchmark models and data: the :class:`Workload` stack, built identically in every process, and the
LightningModule that trains it; He-initialised
blocks for the sections that build their own models; the dataset that hands a Trainer the same batch every step."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from harness.workload import Workload


def make_stack(work: Workload) -> nn.Sequential:
    """The whole model, with the same weights in every process (each stage keeps its own slice)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(work.depth):
        layers += [nn.Linear(work.width, work.width), nn.ReLU()]
    return nn.Sequential(*layers)


LEARNING_RATE = 1e-4  # small: the weights should stay in a normal range over many steps


class StackModule(LightningModule):
    """The benchmark model as a user would write it: the stack in ``self.model``, an MSE loss, the loss logged."""

    def __init__(self, work: Workload) -> None:
        super().__init__()
        self.model = make_stack(work)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, target = batch
        loss = F.mse_loss(self.model(x), target)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LEARNING_RATE)


def make_batch(work: Workload) -> tuple[Tensor, Tensor]:
    """An input batch and a regression target, the same in every process."""
    generator = torch.Generator().manual_seed(1)
    return (
        torch.randn(work.batch, work.width, generator=generator),
        torch.randn(work.batch, work.width, generator=generator),
    )


class HeLinear(nn.Linear):
    """A Linear layer He-initialised for the ReLU after it, so that activations and gradients keep their scale.

    NOTE: with PyTorch's default initialisation, activations and gradients shrink layer by layer through a deep ReLU
    stack, into denormal floats that x86 CPUs compute many times slower: the deepest layers would then be slow for a
    numerical reason, not for their FLOPs. He initialisation keeps the scale, as in a trainable deep ReLU network.
    """

    def reset_parameters(self) -> None:
        nn.init.kaiming_normal_(self.weight, nonlinearity="relu")
        nn.init.zeros_(self.bias)


def he_block(width: int, depth: int) -> nn.Sequential:
    """``depth`` × (:class:`HeLinear` (width, width) + ReLU)."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [HeLinear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


class RepeatedBatch(Dataset):
    """The same whole batch ``length`` times: with ``DataLoader(batch_size=None)`` a step costs no collation."""

    def __init__(self, batch: tuple[Tensor, Tensor], length: int) -> None:
        self.batch, self.length = batch, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return self.batch


def repeated_batch_loader(batch: int, width: int, steps: int) -> DataLoader:
    """``steps`` times the same batch: ``batch`` random rows of ``width`` features and a zero regression target."""
    return DataLoader(RepeatedBatch((torch.randn(batch, width), torch.zeros(batch, width)), steps), batch_size=None)
