"""LightningModules built the memory-efficient way (in ``configure_model`` or under ``init_module``), and one run of
each, shared by the memory-setup tests and their worker."""

from __future__ import annotations

import gc
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_pipe
from helpers.stock_models import Classification

# Wide enough that each weight spans many memory pages: reading a tensor shows in the resident bytes.
WIDTH, DEPTH, CLASSES = 256, 8, 3


def layers(width: int = WIDTH, depth: int = DEPTH) -> nn.Sequential:
    blocks: list[nn.Module] = []
    for i in range(depth):
        blocks += [nn.Linear(12 if i == 0 else width, width), nn.Tanh()]
    return nn.Sequential(*blocks, nn.LayerNorm(width))


class DeferredClassifier(Classification, LightningModule):
    """Builds its layers in ``configure_model``; a parameter of its own made in ``__init__`` (replicated, real)."""

    def __init__(self, lr: float = 0.01, width: int = WIDTH, depth: int = DEPTH) -> None:  # larger rates diverge
        super().__init__()
        self.lr, self.width, self.depth = lr, width, depth
        self.input_scale = nn.Parameter(torch.rand(3, 4) + 0.5)
        self.layers: nn.Sequential | None = None
        self.head: nn.Linear | None = None

    def configure_model(self) -> None:
        if self.layers is not None:  # runs again for trainer.test
            return
        self.layers = layers(self.width, self.depth)
        self.head = nn.Linear(self.width, CLASSES)
        lightning_pipe.init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.layers is not None and self.head is not None
        return self.head(self.layers((x * self.input_scale).flatten(1)))

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class EagerClassifier(DeferredClassifier):
    """The same model built in ``__init__`` (for ``trainer.init_module(empty_init=True)``), with no parameter of the
    LightningModule's own: on the meta device those could not be initialised."""

    def __init__(self, lr: float = 0.01, width: int = WIDTH, depth: int = DEPTH) -> None:
        super().__init__(lr, width, depth)
        del self.input_scale
        self.configure_model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.layers is not None and self.head is not None
        return self.head(self.layers(x.flatten(1)))


def data(samples: int, seed: int) -> DataLoader:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 3, 4, generator=generator)
    y = (x.sum(dim=(1, 2)) > 0).long() + (x[:, 0, 0] > 1).long()
    return DataLoader(TensorDataset(x, y), batch_size=16)


class InitialWeights(Callback):
    """What each rank holds once set up: its state dict, and the parameters alive in the process."""

    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}
        self.real_parameters = 0
        self.meta_in_module = True

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.state = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        # Every real parameter alive in this process, wherever it hangs: only this rank's share may be there.
        gc.collect()  # earlier runs' models, unreachable but not yet collected, must not count
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # isinstance on deprecated torch objects found by the scan warns
            objects = gc.get_objects()
            self.real_parameters = sum(o.numel() for o in objects if isinstance(o, nn.Parameter) and not o.is_meta)
        self.local_parameters = sum(p.numel() for p in pl_module.parameters())
        self.meta_in_module = any(t.is_meta for t in [*pl_module.parameters(), *pl_module.buffers()])


def fit(out: Path, model_kind: str = "deferred", epochs: int = 1, ckpt_path: str | None = None,
        save_after_fit: bool = False, **trainer_kwargs: Any) -> dict[str, Any]:
    """Fit one of the models above and test it; what the run saw and left. ``model_kind``: ``"deferred"`` (built in
    configure_model), ``"init_module"`` (built under ``trainer.init_module(empty_init=True)``) or ``"eager"``
    (built in ``__init__`` with real tensors, as a model that does not use deferred construction). With
    ``save_after_fit``, ``trainer.save_checkpoint(out / "after_fit.ckpt")`` once the test has run."""
    seed_everything(0)
    initial = InitialWeights()
    checkpoint = ModelCheckpoint(dirpath=out / "ckpt", save_last=True)
    trainer = Trainer(accelerator="cpu", max_epochs=epochs, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[initial, checkpoint], **trainer_kwargs)
    if model_kind == "init_module":
        with trainer.init_module(empty_init=True):
            model = EagerClassifier()
    elif model_kind == "eager":
        model = EagerClassifier()
    else:
        model = DeferredClassifier()
    trainer.fit(model, data(64, 0), data(32, 1), ckpt_path=ckpt_path)
    tested = trainer.test(model, data(32, 2), verbose=False)
    if save_after_fit:
        trainer.save_checkpoint(out / "after_fit.ckpt")
    strategy = trainer.strategy
    return {
        "summary": str(strategy.stage_summary()) if isinstance(strategy, lightning_pipe.GPipeStrategy) else None,
        "resident_checkpoint_bytes": getattr(strategy, "resident_checkpoint_bytes", None),
        "initial": initial.state,
        "real_parameters": initial.real_parameters,
        "local_parameters": initial.local_parameters,
        "meta_in_module": initial.meta_in_module,
        "final": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "tested": tested,
        "global_rank": trainer.global_rank,
    }
