"""One rank of the memory-efficient setup section (:mod:`sections.bench_memory_setup`): the tiny, whole and
deferred fits in turn, each one's peak resident memory its own."""

from __future__ import annotations

import gc
import resource
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor, nn

from harness.rank import run_rank
from harness.stack import he_block, repeated_batch_loader
from lightning_pipe import GPipeStrategy

class Stack(LightningModule):
    """The layers in ``self.layers``, built in ``__init__`` or, when ``deferred``, in ``configure_model``."""

    def __init__(self, width: int, depth: int, deferred: bool) -> None:
        super().__init__()
        self.width, self.depth = width, depth
        self.layers: nn.Sequential | None = None if deferred else self._build()

    def _build(self) -> nn.Sequential:
        return he_block(self.width, self.depth)

    def configure_model(self) -> None:
        if self.layers is None:
            self.layers = self._build()

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, target = batch
        assert self.layers is not None
        return F.mse_loss(self.layers(x), target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-4, momentum=0.9)


class PeakAtTrainEnd(Callback):
    """The peak resident set when training ends (before teardown), and the largest stage share seen after a step."""

    def __init__(self) -> None:
        self.peak_bytes = 0
        self.share_bytes = 0

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        parameters = list(pl_module.parameters())
        tensors = [*parameters, *(p.grad for p in parameters if p.grad is not None)]
        for optimizer in trainer.optimizers:
            tensors += [t for state in optimizer.state.values() for t in state.values() if isinstance(t, Tensor)]
        self.share_bytes = max(self.share_bytes, sum(t.numel() * t.element_size() for t in tensors))

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.peak_bytes = _peak_resident_bytes()


def _peak_resident_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _reset_peak() -> None:
    """Set the kernel's peak-RSS mark of this process to its current RSS (Linux's ``clear_refs``, value 5)."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def measure(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The tiny, whole and deferred fits in turn, each one's peak its own (see the module's docstring)."""
    answers = {"tiny": _fit({**spec, "width": 16, "depth": 4, "deferred": True})}
    for name, deferred in (("whole", False), ("deferred", True)):
        gc.collect()  # the previous fit's model and Trainer, held in reference cycles
        _reset_peak()
        answers[name] = _fit({**spec, "deferred": deferred})
    return answers


def _fit(spec: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Stack(spec["width"], spec["depth"], spec["deferred"])
    loader = repeated_batch_loader(spec["batch"], spec["width"], spec["steps"])
    peak = PeakAtTrainEnd()
    strategy = GPipeStrategy(num_micro_batches=spec["stages"], log_bubble_fraction=False)
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=dist.get_world_size(), max_steps=spec["steps"], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, callbacks=[peak],
    )
    trainer.fit(model, loader)
    assert model.layers is not None
    return {
        "stage": strategy.stage_index,
        "peak_bytes": peak.peak_bytes,
        "share_bytes": peak.share_bytes,
        "after_fit_bytes": _peak_resident_bytes(),
        "model_parameters": sum(p.numel() for p in model.layers.parameters()),
    }


if __name__ == "__main__":
    run_rank(measure)
