"""An existing Lightning project, moved onto a 2-stage pipeline by the two lines marked ``# PIPELINE``.

    python examples/existing_project.py               # 2 pipeline stages on the CPU
    python examples/existing_project.py --devices 4   # 4 stages

The project is an ordinary one: it tells test code from library code in 128-byte snippets of the Python standard
library. Its model is a component (``SnippetEncoder``) holding a convolutional stack in ``self.model``, an
``nn.Sequential``, with a reshape before the call and a classifier head after it; it computes torchmetrics
accuracies and logs with ``self.log``. Nothing in the module knows about the pipeline: the strategy finds
``encoder.model`` (the ``nn.Sequential`` with the most parameters) and splits its layers over the processes.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule, LightningModule, Trainer, seed_everything
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset
from torchmetrics.classification import MulticlassAccuracy

import lightning_pipe  # noqa: F401  PIPELINE (1 of 2): registers strategy="gpipe"
from lm import stdlib_sources


class Snippets(Dataset):
    """128-byte windows of source files, labelled 1 when the file is test code (a ``test`` directory or file)."""

    def __init__(self, files: list[Path], length: int = 128) -> None:
        windows, labels = [], []
        for path in files:
            data = path.read_bytes()
            if len(data) < length:
                continue
            whole = bytearray(data[: len(data) // length * length])
            windows.append(torch.frombuffer(whole, dtype=torch.uint8).view(-1, length))
            is_test = any(part.startswith("test") for part in path.parts[-3:])
            labels.append(torch.full((len(windows[-1]),), int(is_test)))
        self.windows = torch.cat(windows).long()
        self.labels = torch.cat(labels)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return self.windows[index], self.labels[index]


class SnippetData(LightningDataModule):
    """Every 10th file is held out for validation (split by file, so no validation text is seen in training)."""

    def __init__(self, batch_size: int = 64, max_files: int = 300) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.max_files = max_files

    def setup(self, stage: str) -> None:
        files = stdlib_sources()
        files = files[:: max(1, len(files) // self.max_files)]  # a spread-out subset keeps start-up short
        self.train_set = Snippets([path for i, path in enumerate(files) if i % 10 != 0])
        self.val_set = Snippets([path for i, path in enumerate(files) if i % 10 == 0])

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=256)


class SnippetEncoder(nn.Module):
    """Byte embeddings, then a stack of 1-d convolutions in ``self.model`` ending in a pooled feature vector."""

    def __init__(self, channels: int = 32, depth: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, channels)
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Conv1d(channels, channels, kernel_size=5, padding=2), nn.ReLU()]
        layers += [nn.AdaptiveMaxPool1d(1), nn.Flatten()]
        self.model = nn.Sequential(*layers)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens).transpose(1, 2)  # (batch, length, channels) -> (batch, channels, length)
        return self.model(x)


class SnippetClassifier(LightningModule):
    def __init__(self, channels: int = 32, depth: int = 6, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.encoder = SnippetEncoder(channels, depth)
        self.head = nn.Linear(channels, 2)
        self.train_acc = MulticlassAccuracy(num_classes=2)
        self.val_acc = MulticlassAccuracy(num_classes=2)

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.encoder(tokens))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> dict[str, Tensor]:
        tokens, labels = batch
        logits = self(tokens)
        loss = F.cross_entropy(logits, labels)
        self.train_acc(logits, labels)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        return {"loss": loss, "preds": logits.argmax(dim=1)}

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        tokens, labels = batch
        logits = self(tokens)
        self.val_acc(logits, labels)
        self.log("val_loss", F.cross_entropy(logits, labels), prog_bar=True, sync_dist=True)
        self.log("val_acc", self.val_acc, prog_bar=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2, help="processes, and so pipeline stages")
    parser.add_argument("--max-steps", type=int, default=100)
    parser.add_argument("--val-every", type=int, default=50, help="validate every this many steps")
    args = parser.parse_args()

    seed_everything(0)
    model, data = SnippetClassifier(), SnippetData()
    trainer = Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="gpipe",  # PIPELINE (2 of 2): was the default strategy
        max_steps=args.max_steps,
        val_check_interval=args.val_every,
        check_val_every_n_epoch=None,
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(model, datamodule=data)
    if trainer.is_global_zero:
        metrics = {key: round(float(value), 4) for key, value in sorted(trainer.callback_metrics.items())}
        print(f"final metrics: {json.dumps(metrics)}")


if __name__ == "__main__":
    main()
