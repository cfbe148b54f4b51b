"""Models for tensor parallelism inside a stage: a plain PyTorch attention-and-MLP block with its user plan, and the
Hugging Face models whose own plans split them (tests/test_tensor_parallel.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, TensorDataset

import lightning_pipe
from helpers.stock_models import LlamaModule, Qwen2Module

WIDTH, HEADS, HIDDEN, TOKENS, VOCAB, CLASSES = 16, 4, 32, 6, 24, 3

# Block-relative names: the attention's projections and the MLP split as Megatron splits them.
BLOCK_PLAN = {"attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.out": "rowwise",
              "mlp.up": "colwise", "mlp.down": "rowwise"}


class Attention(nn.Module):
    """Causal self-attention whose head count per rank comes from the projection's width (the view's ``-1``), as
    Hugging Face's attention reads it: split column-wise over T ranks, each holds ``num_heads / T`` heads."""

    def __init__(self, width: int = WIDTH, num_heads: int = HEADS) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, width // num_heads
        self.q, self.k, self.v, self.out = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        q, k, v = (proj(x).view(batch, tokens, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(attended.transpose(1, 2).reshape(batch, tokens, -1))


class MLP(nn.Module):
    def __init__(self, width: int = WIDTH, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """A pre-norm transformer block: the norms stay whole on every tensor-parallel rank."""

    def __init__(self, width: int = WIDTH, num_heads: int = HEADS) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn, self.mlp = Attention(width, num_heads), MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class BlockClassifier(LightningModule):
    """Tokens embedded, four blocks (``blocks``), mean-pooled into a head: the embedding and the head stay outside."""

    def __init__(self, lr: float = 0.5, depth: int = 4, num_heads: int = HEADS, sync_dist: bool = False,
                 momentum: float = 0.0) -> None:
        super().__init__()
        self.lr, self.sync_dist, self.momentum = lr, sync_dist, momentum
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.Sequential(*(Block(WIDTH, num_heads) for _ in range(depth)))
        self.head = nn.Linear(WIDTH, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)).mean(dim=1))

    def training_step(self, batch, batch_idx):
        tokens, y = batch
        loss = F.cross_entropy(self(tokens), y)
        self.log("train_loss", loss, sync_dist=self.sync_dist)
        return loss

    def validation_step(self, batch, batch_idx):
        tokens, y = batch
        self.log("val_loss", F.cross_entropy(self(tokens), y), sync_dist=self.sync_dist)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=self.momentum)


class ConfiguredBlockClassifier(BlockClassifier):
    """Lightning's convention (as under its ModelParallelStrategy): the blocks built in ``configure_model`` and split
    there by the module's own ``parallelize_module`` over ``self.device_mesh["tensor_parallel"]``. Without a mesh
    (one device) they stay whole; either way their weights are those a pipeline of any split starts from."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.depth, self.num_heads, self.blocks = len(self.blocks), HEADS, None

    def configure_model(self) -> None:
        if self.blocks is not None:  # configure_model runs again for trainer.test/validate/predict
            return
        self.blocks = nn.Sequential(*(Block(WIDTH, self.num_heads) for _ in range(self.depth)))
        mesh = self.device_mesh
        if mesh is not None and mesh["tensor_parallel"].size() > 1:
            styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
            for block in self.blocks:
                parallelize_module(block, mesh["tensor_parallel"], {n: styles[s]() for n, s in BLOCK_PLAN.items()})
        lightning_pipe.init_weights(self)


def token_classes(samples: int, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (samples, TOKENS), generator=generator)
    return TensorDataset(tokens, tokens[:, 0] % CLASSES)


def token_loaders(train_samples: int = 64, val_samples: int = 16, batch_size: int = 8) -> tuple[DataLoader, DataLoader]:
    return (DataLoader(token_classes(train_samples, 0), batch_size=batch_size),
            DataLoader(token_classes(val_samples, 1), batch_size=batch_size))


TENSOR_PARALLEL_MODELS = {
    "block": BlockClassifier,
    "block_synced": lambda **kwargs: BlockClassifier(sync_dist=True, **kwargs),
    "block_momentum": lambda **kwargs: BlockClassifier(momentum=0.9, **kwargs),
    "block_configured": ConfiguredBlockClassifier,
    # SGD (not AdamW, which amplifies round-off) so that weights compare at 1e-5; full-length sequences, so that the
    # mean over label tokens is a mean over samples too.
    "llama": lambda **kwargs: LlamaModule(sgd_lr=0.5, padded=False, **kwargs),
    "qwen2": lambda **kwargs: Qwen2Module(sgd_lr=0.5, padded=False, **kwargs),
}


def loaders_for(model: LightningModule, batch_size: int = 8) -> tuple[DataLoader, DataLoader] | None:
    """The plain model's loaders; ``None`` for the Hugging Face modules, which bring their own."""
    return token_loaders(batch_size=batch_size) if isinstance(model, BlockClassifier) else None
