"""One rank of the memory-efficient setup section (:mod:`sections.bench_memory_setup`): the tiny, whole and
deferred runs in turn (fit, then test and a checkpoint), each phase's peak resident memory its own."""

from __future__ import annotations

import gc
from pathlib import Path
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

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, target = batch
        assert self.layers is not None
        self.log("test_loss", F.mse_loss(self.layers(x), target))

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
        self.peak_bytes = peak_resident_bytes()


def peak_resident_bytes() -> int:
    """The kernel's peak-RSS mark of this process (``VmHWM``), which ``reset_peak`` resets."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # Linux reports KiB
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak() -> None:
    """Free the garbage (the previous run's model and Trainer, held in reference cycles), then set the kernel's
    peak-RSS mark of this process to its current RSS (Linux's ``clear_refs``, value 5)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def measure(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The tiny, whole and deferred runs in turn, each phase's peak its own (see the module's docstring)."""
    answers = {"tiny": _run({**spec, "width": 16, "depth": 4, "deferred": True, "name": "tiny"}, reset=False)}
    answers["whole"] = _run({**spec, "deferred": False, "name": "whole"}, reset=True, fit_only=True)
    answers["deferred"] = _run({**spec, "deferred": True, "name": "deferred"}, reset=True)
    return answers


def _run(spec: dict[str, Any], reset: bool, fit_only: bool = False) -> dict[str, Any]:
    """Fit, then (unless ``fit_only``) test and save a checkpoint; the peak of each phase, the mark reset before
    each when ``reset`` (the tiny run keeps the process's peak since its start: the fixed footprint)."""
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
    if reset:
        reset_peak()
    trainer.fit(model, loader)
    phases = {"fit": peak.peak_bytes, "after_fit": peak_resident_bytes()}
    if not fit_only:
        # The launch's working directory, shared by the ranks (a sharded checkpoint is one directory for all).
        for phase, action in (
            ("test", lambda: trainer.test(model, loader, verbose=False)),
            ("checkpoint", lambda: trainer.save_checkpoint(Path.cwd() / f"checkpoint_{spec['name']}")),
        ):
            if reset:
                reset_peak()
            action()
            phases[phase] = peak_resident_bytes()
    return {
        "stage": strategy.stage_index,
        "phases": phases,
        "share_bytes": peak.share_bytes,
        "model_parameters": sum(p.numel() for p in model.layers.parameters()),  # (meta tensors count too)
    }


if __name__ == "__main__":
    run_rank(measure)
