"""A byte-level language model over the Python standard library's own source: the example's model and data.

The data needs no download: every Python installation ships its standard library as ``.py`` files. The model is a
small GPT (causal transformer) whose blocks sit in one ``nn.Sequential``, the module the ``gpipe`` strategy splits
into stages; the embedding before it and the head after it are ordinary modules that every stage keeps a copy of.
"""

from __future__ import annotations

import math
import os
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningDataModule, LightningModule
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset, Sampler

VOCAB = 256  # one token per byte value


# ---- data ------------------------------------------------------------------------------------------------------------


def stdlib_sources(root: str | Path | None = None) -> list[Path]:
    """The standard library's ``.py`` files, sorted by path so that every machine and every rank reads the same
    order (third-party ``site-packages`` are left out: they differ between machines)."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    found: list[Path] = []
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = [d for d in subdirectories if d not in ("site-packages", "dist-packages", "__pycache__")]
        found += [Path(directory, name) for name in files if name.endswith(".py")]
    if not found:
        raise FileNotFoundError(f"no .py files under {root}; pass data.root=/path/to/python/sources")
    return sorted(found, key=lambda path: path.relative_to(root).as_posix())


class ByteChunks(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` bytes: input bytes and the same bytes shifted by one (targets)."""

    def __init__(self, data: Tensor, seq_len: int, starts: Tensor | None = None) -> None:
        self.data = data
        self.seq_len = seq_len
        self.starts = starts if starts is not None else torch.arange(0, len(data) - seq_len - 1, seq_len + 1)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        start = int(self.starts[index])
        window = self.data[start : start + self.seq_len + 1].long()
        return window[:-1], window[1:]


class EpochShuffle(Sampler[int]):
    """A fresh order of the training windows every epoch, drawn from ``(seed, epoch)`` alone (Lightning calls
    ``set_epoch``), so that a resumed run can take up an epoch where its checkpoint left it: ``skip`` leaves out the
    first windows of the next epoch iterated, those the run trained on before it stopped."""

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed = size, seed
        self.epoch = self.skip = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size - self.skip

    def __iter__(self):
        order = torch.randperm(self.size, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        skip, self.skip = self.skip, 0
        return iter(order[skip:].tolist())


class StdlibBytes(LightningDataModule):
    """Byte windows of the standard library's sources; every ``val_every``-th file (in path order) is held out.

    Splitting by file, not by window, keeps validation text unseen in training. Validation uses ``val_windows``
    windows spread evenly over the held-out files, so that it is quick and always the same. Training windows come in
    an order drawn from ``seed`` and the epoch: a run resumed from a checkpoint taken mid-epoch trains on the batches
    an uninterrupted run would have (Lightning restarts an epoch's data loader from its beginning).
    """

    def __init__(
        self,
        seq_len: int = 64,
        batch_size: int = 32,
        val_every: int = 20,
        val_windows: int = 1024,
        root: str | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_every = val_every
        self.val_windows = val_windows
        self.root = root
        self.seed = seed
        self.train_set: ByteChunks | None = None
        self.val_set: ByteChunks | None = None

    def setup(self, stage: str) -> None:
        if self.train_set is not None:
            return
        files = stdlib_sources(self.root)
        train = [path for i, path in enumerate(files) if i % self.val_every != 0]
        val = [path for i, path in enumerate(files) if i % self.val_every == 0]
        self.train_set = ByteChunks(_read_bytes(train), self.seq_len)
        held_out = ByteChunks(_read_bytes(val), self.seq_len)
        picks = torch.linspace(0, len(held_out) - 1, min(self.val_windows, len(held_out))).long()
        self.val_set = ByteChunks(held_out.data, self.seq_len, held_out.starts[picks])

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None
        order = EpochShuffle(len(self.train_set), self.seed)
        loop = self.trainer.fit_loop if self.trainer is not None else None
        batches = loop.epoch_loop.batch_progress if loop is not None and loop.restarting else None
        if batches is not None and not batches.is_last_batch:  # resumed mid-epoch: skip the batches trained on
            order.set_epoch(self.trainer.current_epoch)
            order.skip = batches.current.processed * self.batch_size
        return DataLoader(self.train_set, batch_size=self.batch_size, sampler=order, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        assert self.val_set is not None
        return DataLoader(self.val_set, batch_size=self.batch_size)


def _read_bytes(paths: list[Path]) -> Tensor:
    """All files' bytes, one after the other, each followed by a NUL byte that marks the file boundary."""
    blob = b"".join(path.read_bytes() + b"\0" for path in paths)
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


# ---- model -----------------------------------------------------------------------------------------------------------


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then an MLP, each with a residual connection."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width={width} is not divisible by heads={heads}; pick a width that heads divides.")
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: Tensor) -> Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class ByteGPT(LightningModule):
    """A small GPT over bytes. ``self.blocks`` is the ``nn.Sequential`` that the pipeline splits into stages."""

    def __init__(
        self,
        width: int = 64,
        depth: int = 8,
        heads: int = 4,
        seq_len: int = 64,
        lr: float = 3e-3,
        warmup_steps: int = 20,
        total_steps: int = 300,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.token = nn.Embedding(VOCAB, width)
        self.position = nn.Parameter(torch.randn(seq_len, width) * 0.02)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(depth)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)
        # A sample input: lets strategy.balance=time|memory profile the blocks before the data is set up.
        self.example_input_array = torch.zeros(2, seq_len, dtype=torch.long)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.token(tokens) + self.position[: tokens.shape[1]]
        return self.head(self.norm(self.blocks(x)))

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        tokens, targets = batch
        logits = self(tokens)
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss = self._loss(batch)
        # sync_dist averages over data-parallel replicas; the stages of one pipeline already agree.
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        self.log("val_bits_per_byte", loss / math.log(2), sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        warmup, total = self.hparams.warmup_steps, max(self.hparams.total_steps, 1)

        def warmup_then_cosine(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_then_cosine)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
