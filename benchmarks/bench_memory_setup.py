"""Memory-efficient setup: peak resident memory per rank with and without deferred construction, through ``fit``,
``test`` and checkpointing.

A stack of ``depth`` × (Linear(W, W) + ReLU), about 2 GiB of parameters at full size, trains for a few steps on 4
stages (2 in quick mode), with SGD with momentum, so that each stage's share is its parameters, their gradients and
one optimizer buffer of the same size. The processes (one per stage) run three runs in turn: a tiny model first,
whose peak is the fixed footprint of a process (Python, torch, Lightning, the process group, the Trainer, and the
code of testing and sharded checkpointing, which it runs too); then the model built in ``__init__`` (every rank
builds all of it; fit only); then built in ``configure_model()`` (every rank materialises only its stage). Before
each of the later runs, and before each phase of the deferred run, the garbage is collected and the kernel's
peak-RSS mark reset (``/proc/self/clear_refs``), so each peak is that phase's own, over the footprint already there;
whatever the earlier runs left behind counts against the deferred run, the last. Each rank reports its peak
resident set (``VmHWM``) in each phase of the deferred run: setup and training (read when training ends); the end of
``fit`` (its teardown: a model built on the meta device stays distributed, nothing is gathered); ``trainer.test``;
and ``trainer.save_checkpoint`` after them (sharded by default for such a model: each rank writes its own stage).
"""

from __future__ import annotations

import gc
from pathlib import Path
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
PHASES = ("fit", "after_fit", "test", "checkpoint")


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
        fixed = max(tiny[rank]["phases"].values())
        share = deferred[rank]["share_bytes"]
        phases = deferred[rank]["phases"]
        row = {
            "rank": rank,
            "stage": deferred[rank]["stage"],
            "share_bytes": share,
            "fixed_bytes": fixed,
            "peak_deferred_bytes": phases["fit"],
            "phases_deferred_bytes": phases,
            "peak_whole_bytes": whole[rank]["phases"]["fit"],
            "after_fit_deferred_bytes": phases["after_fit"],
            "ratio": max(phases.values()) / (share + fixed),
        }
        data_rows.append(row)
        rows.append([
            rank, row["stage"], _gib(share), _gib(fixed), _gib(share + fixed),
            *(_gib(phases[phase]) for phase in PHASES), f"{row['ratio']:.2f}", _gib(row["peak_whole_bytes"]),
        ])
    table = markdown_table(
        ["rank", "stage", "stage share (GiB)", "fixed footprint (GiB)", "share + fixed (GiB)",
         "fit (GiB)", "end of fit (GiB)", "test (GiB)", "checkpoint (GiB)",
         "worst over share + fixed", "fit, built in __init__ (GiB)"],
        rows,
    )
    worst = max(row["ratio"] for row in data_rows)
    saved = min(row["peak_whole_bytes"] - row["peak_deferred_bytes"] for row in data_rows)
    parameters = whole[0]["model_parameters"]
    markdown = (
        f"{spec['depth']} × (Linear({spec['width']}, {spec['width']}) + ReLU): {parameters * 4 / GIB:.2f} GiB of"
        f" parameters on {stages} stages, batch {spec['batch']}, {spec['steps']} training steps, SGD with momentum;"
        " one compute thread per process. Peak resident set per rank (`VmHWM`) in each phase of the run built in"
        " `configure_model()`: setup and training (`fit`), the end of fit (its teardown), `trainer.test`, and"
        " `trainer.save_checkpoint` after them (sharded: each rank writes its own stage). Stage share: the rank's"
        " parameters, gradients and momentum buffers. Fixed footprint: the peak of the same phases with a"
        " 4 × Linear(16, 16) model, in fresh processes; the two large runs follow in the same processes, the peak"
        " mark reset before each phase (see the module's docstring). The model stays distributed after fit: no"
        " rank receives another stage's layers.\n\n"
        f"{table}\n\n"
        + verdict(
            f"every phase's peak with `configure_model()` within {TARGET_RATIO}× (stage share + fixed footprint) on"
            " every rank",
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
        self.peak_bytes = _peak_resident_bytes()


def _peak_resident_bytes() -> int:
    """The kernel's peak-RSS mark of this process (``VmHWM``), which ``_reset_peak`` resets."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # Linux reports KiB
    raise RuntimeError("no VmHWM in /proc/self/status")


def _reset_peak() -> None:
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
        _reset_peak()
    trainer.fit(model, loader)
    phases = {"fit": peak.peak_bytes, "after_fit": _peak_resident_bytes()}
    if not fit_only:
        # The launch's working directory, shared by the ranks (a sharded checkpoint is one directory for all).
        for phase, action in (
            ("test", lambda: trainer.test(model, loader, verbose=False)),
            ("checkpoint", lambda: trainer.save_checkpoint(Path.cwd() / f"checkpoint_{spec['name']}")),
        ):
            if reset:
                _reset_peak()
            action()
            phases[phase] = _peak_resident_bytes()
    return {
        "stage": strategy.stage_index,
        "phases": phases,
        "share_bytes": peak.share_bytes,
        "model_parameters": sum(p.numel() for p in model.layers.parameters()),  # (meta tensors count too)
    }
