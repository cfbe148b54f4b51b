"""Memory-efficient setup: peak resident memory per rank with and without deferred construction.

A stack of ``depth`` × (Linear(W, W) + ReLU), about 2 GiB of parameters at full size, trains for a few steps on 4
stages (2 in quick mode), with SGD with momentum, so that each stage's share is its parameters, their gradients and
one optimizer buffer of the same size. The processes (one per stage) run three fits in turn: a tiny model first,
whose peak is the fixed footprint of a process (Python, torch, Lightning, the process group, the Trainer); then the
model built in ``__init__`` (every rank builds all of it); then built in ``configure_model()`` (every rank
materialises only its stage). Before each of the later fits the previous model is freed and the kernel's peak-RSS
mark reset (``/proc/self/clear_refs``), so each peak is that fit's own, over the footprint already there; whatever
the earlier fits left behind counts against the deferred run, the last. Each rank reports its peak resident set
(``ru_maxrss``) at the end of training, before teardown: setup and training, the phase that must fit. After ``fit``
a model built deferred comes whole to global rank 0, which then holds it in host memory once, as a consolidated
checkpoint does; that peak has its own column.
"""

from __future__ import annotations

import gc
import resource
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor, nn

from launch import launch
from lightning_pipe import GPipeStrategy
from report import markdown_table, verdict
from stack import he_block, repeated_batch_loader

TARGET_RATIO = 1.2  # peak with deferred construction over (stage share + fixed footprint)
GIB = 2**30


def sizes(quick: bool) -> dict[str, int]:
    if quick:  # checks that the section runs: two processes, a tiny model
        return {"stages": 2, "width": 64, "depth": 8, "batch": 8, "steps": 2}
    # 32 × 4096² float32 weights: 2.0 GiB of parameters, 512 MiB per stage.
    return {"stages": 4, "width": 4096, "depth": 32, "batch": 8, "steps": 3}


def run(quick: bool) -> dict[str, Any]:
    spec = sizes(quick)
    stages = spec["stages"]
    answers = launch("bench_memory_setup", "measure", stages, spec)
    tiny, whole, deferred = ([answer[name] for answer in answers] for name in ("tiny", "whole", "deferred"))
    rows, data_rows = [], []
    for rank in range(stages):
        fixed = tiny[rank]["peak_bytes"]
        share = deferred[rank]["share_bytes"]
        row = {
            "rank": rank,
            "stage": deferred[rank]["stage"],
            "share_bytes": share,
            "fixed_bytes": fixed,
            "peak_deferred_bytes": deferred[rank]["peak_bytes"],
            "peak_whole_bytes": whole[rank]["peak_bytes"],
            "after_fit_deferred_bytes": deferred[rank]["after_fit_bytes"],
            "ratio": deferred[rank]["peak_bytes"] / (share + fixed),
        }
        data_rows.append(row)
        rows.append([
            rank, row["stage"], _gib(share), _gib(fixed), _gib(share + fixed), _gib(row["peak_deferred_bytes"]),
            f"{row['ratio']:.2f}", _gib(row["peak_whole_bytes"]), _gib(row["after_fit_deferred_bytes"]),
        ])
    table = markdown_table(
        ["rank", "stage", "stage share (GiB)", "fixed footprint (GiB)", "share + fixed (GiB)",
         "peak, configure_model (GiB)", "over share + fixed", "peak, built in __init__ (GiB)",
         "after fit, configure_model (GiB)"],
        rows,
    )
    worst = max(row["ratio"] for row in data_rows)
    saved = min(row["peak_whole_bytes"] - row["peak_deferred_bytes"] for row in data_rows)
    parameters = whole[0]["model_parameters"]
    markdown = (
        f"{spec['depth']} × (Linear({spec['width']}, {spec['width']}) + ReLU): {parameters * 4 / GIB:.2f} GiB of"
        f" parameters on {stages} stages, batch {spec['batch']}, {spec['steps']} training steps, SGD with momentum;"
        " one compute thread per process. Peak resident set per rank (`ru_maxrss`) through setup and training."
        " Stage share: the rank's parameters, gradients and momentum buffers. Fixed footprint: the peak of the same"
        " run with a 4 × Linear(16, 16) model, in fresh processes; the two large runs follow in the same processes,"
        " the peak mark reset before each (see the module's docstring). After fit, global rank 0 (the last"
        " stage) receives the other stages' trained layers, so that the launching process holds the whole model as"
        " on one device.\n\n"
        f"{table}\n\n"
        + verdict(
            f"peak with `configure_model()` within {TARGET_RATIO}× (stage share + fixed footprint) on every rank",
            worst <= TARGET_RATIO,
            f"{worst:.2f}× at worst",
        )
        + f"\n\nBuilt in `__init__`, every rank holds all stages' parameters: deferred construction lowers the peak by"
        f" {saved / 2**20:.0f} MiB on the rank where it gains least."
    )
    data = {**spec, "model_parameters": parameters, "rows": data_rows,
            "worst_ratio": worst, "target_ratio": TARGET_RATIO}
    return {"title": "Memory-efficient setup: deferred construction", "markdown": markdown, "data": data}


def _gib(count: float) -> str:
    return f"{count / GIB:.2f}"


# ---- the worker (runs on every rank, through benchmarks/worker.py) ---------------------------------------------


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
