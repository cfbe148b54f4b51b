"""One rank of the holding section (:mod:`sections.bench_holding`): a Llama-shaped model with Llama-3-8B's
proportions built on the meta device, trained with Adam for a few steps; what this rank holds (parameters, gradients,
optimizer state) and its peak resident memory, run by run."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from harness.rank import run_rank
from lightning_pipe import GPipeStrategy
from ranks.memory_setup import peak_resident_bytes, reset_peak


class Attention(nn.Module):
    """Grouped-query attention as Llama's: ``heads`` query heads sharing ``kv_heads`` key and value heads."""

    def __init__(self, width: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, width // heads
        self.q = nn.Linear(width, width, bias=False)
        self.k = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.v = nn.Linear(width, kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(width, width, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k, v = (proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2) for proj in (self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, width: int, hidden: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.attention_norm, self.mlp_norm = nn.RMSNorm(width), nn.RMSNorm(width)
        self.attention = Attention(width, heads, kv_heads)
        self.gate, self.up = nn.Linear(width, hidden, bias=False), nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class LlamaShaped(LightningModule):
    """Llama-3-8B's shape scaled down: vocabulary / width 31.3, MLP width 3.5 × width, 4 query heads per key-value
    head, an untied head; the embedding and the head are 13% of the parameters. Built in ``configure_model``."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.width, self.depth = width, depth
        self.vocab = round(width * 128256 / 4096)
        self.embed: nn.Embedding | None = None

    def configure_model(self) -> None:
        if self.embed is not None:
            return
        heads = max(4, self.width // 32)
        self.embed = nn.Embedding(self.vocab, self.width)
        self.layers = nn.ModuleList(Block(self.width, self.width * 7 // 2, heads, heads // 4) for _ in range(self.depth))
        self.norm = nn.RMSNorm(self.width)
        self.head = nn.Linear(self.width, self.vocab, bias=False)

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        h = self.embed(batch[:, :-1])
        for layer in self.layers:
            h = layer(h)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)


class Held(Callback):
    """After each training step: the bytes of this rank's parameters, their gradients and the optimizer's state."""

    def __init__(self) -> None:
        self.parts: dict[str, int] = {}
        self.peak_bytes = 0
        self.step_seconds: list[float] = []  # each training step's, batch start to batch end

    def on_train_batch_start(self, *args: Any) -> None:
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self.step_seconds.append(time.perf_counter() - self._started)
        parameters = list(pl_module.parameters())
        state = [t for opt in trainer.optimizers for s in opt.state.values() for t in s.values()
                 if isinstance(t, Tensor) and t.dim() > 0]
        self.parts = {
            "parameters": _bytes(parameters),
            "gradients": _bytes([p.grad for p in parameters if p.grad is not None]),
            "optimizer": _bytes(state),
        }

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.peak_bytes = peak_resident_bytes()


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """The runs of ``spec["runs"]`` in turn in these processes, each peak its own; the first is a tiny model (the
    fixed footprint of a process)."""
    return {run["name"]: _run(spec, run) for run in spec["runs"]}


def _run(spec: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(0)
    width, depth = run.get("width", spec["width"]), run.get("depth", spec["depth"])
    model = LlamaShaped(width, depth)
    tokens = torch.randint(0, model.vocab, (spec["steps"] * spec["batch"], spec["length"] + 1))
    loader = DataLoader(tokens, batch_size=spec["batch"])
    options = dict(run.get("strategy", {}))
    read: list[str] = []
    if "pretrained" in run:
        options["pretrained"] = _pretrained_file(run["pretrained"], width, depth)
        _record_reads(read)
    held = Held()
    strategy = GPipeStrategy(num_micro_batches=spec["micro_batches"], log_bubble_fraction=False, **options)
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=dist.get_world_size(), max_steps=spec["steps"], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, callbacks=[held],
    )
    reset_peak()
    trainer.fit(model, loader)
    whole = _whole_model_bytes(width, depth)
    blocks = [len(row.blocks) for row in strategy.stage_summary().rows]
    return {"stage": strategy.stage_index, "parts": held.parts, "peak_bytes": held.peak_bytes, "whole": whole,
            "step_seconds": held.step_seconds,
            "blocks_per_stage": blocks, "read_bytes": _stored_bytes(options.get("pretrained"), read)}


def _record_reads(read: list[str]) -> None:
    """Collect the stored names this rank reads from the pretrained file (the strategy's own load, wrapped)."""
    from lightning_pipe.checkpoints.pretrained import PretrainedLoad

    fill = PretrainedLoad.fill
    if getattr(fill, "recording", False):
        fill = fill.original  # type: ignore[attr-defined]

    def recording(self: Any, module: nn.Module, dtype: torch.dtype) -> list[str]:
        names = fill(self, module, dtype)
        read.extend(names)
        return names

    recording.recording, recording.original = True, fill  # type: ignore[attr-defined]
    PretrainedLoad.fill = recording  # type: ignore[method-assign]


def _stored_bytes(path: str | None, names: list[str]) -> int:
    if path is None:
        return 0
    from safetensors import safe_open

    with safe_open(path, "pt") as stored:
        return sum(_numel(stored.get_slice(name).get_shape()) * 4 for name in names)  # float32


def _numel(shape: list[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _whole_model_bytes(width: int, depth: int) -> dict[str, int]:
    """The whole model's parameter bytes, counted on the meta device, and the share the embedding and head hold."""
    model = LlamaShaped(width, depth)
    with torch.device("meta"):
        model.configure_model()
    total = sum(p.numel() * 4 for p in model.parameters())
    ends = sum(p.numel() * 4 for p in [*model.embed.parameters(), *model.head.parameters()])  # type: ignore[union-attr]
    return {"parameters": total, "embedding_and_head": ends}


def _pretrained_file(directory: str, width: int, depth: int) -> str:
    """A safetensors file of the model's weights, written once by rank 0 (the others wait)."""
    path = Path(directory) / f"llama_shaped_{width}_{depth}.safetensors"
    if dist.get_rank() == 0 and not path.exists():
        from safetensors.torch import save_file

        torch.manual_seed(1)
        model = LlamaShaped(width, depth)
        model.configure_model()
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    dist.barrier()
    return str(path)


def _bytes(tensors: list[Tensor]) -> int:
    """The bytes this rank holds of ``tensors``: of a tensor sharded over the replicas (a DTensor), its shard."""
    local = [t.to_local() if isinstance(t, DTensor) else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


if __name__ == "__main__":
    run_rank(measure)
