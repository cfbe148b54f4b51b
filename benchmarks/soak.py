"""Soak: a long CPU run under ``Trainer(strategy="gpipe")`` must not grow in memory, threads or open files.

Usage::

    python benchmarks/soak.py                                # 2,000 steps on 4 stages (the recorded run)
    python benchmarks/soak.py --steps 200 --stages 2 --json soak.json
    python benchmarks/soak.py --no-stall-watchdog            # the same run with the stall watchdog off, to compare

Every rank samples its own resident memory (``VmRSS``), thread count and open file descriptors from ``/proc/self``
at fixed steps; rank 0 gathers the samples and prints one table row per rank. The run holds what long trainings
hold: epochs of 16 steps with a validation loop at each end, a torchmetrics metric logged every step, a CSV logger
(with the logged bubble fraction) and a ``ModelCheckpoint`` writing ``last.ckpt`` every 10 epochs. The check: at
the last step each rank's resident memory is within 5% of what it was at the first sampled step after warm-up
(step 200 of 2,000), and its threads and open files are no more than then.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

import lightning_pipe

_DIRECTORY_VARIABLE = "LIGHTNING_PIPE_SOAK_DIR"  # where the logs and checkpoints of a run go (removed after it)
RSS_LIMIT = 0.05  # resident memory at the last step, relative to the reference step
WIDTH, DEPTH, BATCH, CLASSES = 64, 8, 32, 4
TRAIN_SAMPLES, VAL_SAMPLES = 16 * BATCH, 2 * BATCH  # 16 training and 2 validation steps per epoch


def process_resources() -> dict[str, int]:
    """This process's resident memory (bytes), threads and open file descriptors, read from ``/proc/self``."""
    status = Path("/proc/self/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in status if ":" in line)
    return {
        "rss_bytes": int(fields["VmRSS"].split()[0]) * 1024,
        "threads": int(fields["Threads"]),
        "open_files": len(os.listdir("/proc/self/fd")),
    }


class Classifier(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(16, WIDTH), nn.ReLU()]
        for _ in range(DEPTH - 1):
            layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(WIDTH, CLASSES)
        self.accuracy = MulticlassAccuracy(num_classes=CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.accuracy(logits, y)
        self.log("train_loss", loss)
        self.log("train_acc", self.accuracy, on_step=True, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def dataset(samples: int, seed: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 16, generator=generator)
    return TensorDataset(x, (x[:, :CLASSES].argmax(dim=1)))


class ResourceSampler(Callback):
    """Samples :func:`process_resources` after the given training steps; gathers every rank's samples at the end."""

    def __init__(self, steps: list[int]) -> None:
        self.steps = set(steps)
        self.samples: dict[int, dict[str, float]] = {}
        self.gathered: list[dict[int, dict[str, float]]] = []
        self.started = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step in self.steps and step not in self.samples:
            self.samples[step] = {**process_resources(), "seconds": time.perf_counter() - self.started}

    def on_train_end(self, trainer, pl_module):
        gathered: list[Any] = [None] * trainer.world_size
        torch.distributed.all_gather_object(gathered, self.samples)
        self.gathered = gathered


def soak(steps: int, stages: int, directory: Path, stall_watchdog: bool = True) -> dict[str, Any]:
    """Train for ``steps`` steps on ``stages`` stages (the stall watchdog on, by default, as in any run); on global
    rank 0 the per-rank samples and the verdicts."""
    reference = steps // 10  # after warm-up: allocator pools, the first epochs and checkpoints are in place
    sample_steps = sorted({1, reference, *range(reference, steps + 1, max(1, steps // 10)), steps})
    seed_everything(0)
    sampler = ResourceSampler(sample_steps)
    trainer = Trainer(
        strategy=lightning_pipe.GPipeStrategy(num_micro_batches=8, stall_watchdog=stall_watchdog),
        accelerator="cpu",
        devices=stages,
        max_steps=steps,
        logger=CSVLogger(directory, name="soak"),
        log_every_n_steps=8,
        callbacks=[sampler, ModelCheckpoint(dirpath=directory / "ckpt", save_last=True, every_n_epochs=10)],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(
        Classifier(),
        DataLoader(dataset(TRAIN_SAMPLES, 0), batch_size=BATCH),
        DataLoader(dataset(VAL_SAMPLES, 1), batch_size=BATCH),
    )
    if not trainer.is_global_zero:
        return {}
    ranks = []
    for rank, samples in enumerate(sampler.gathered):
        first, last = samples[reference], samples[steps]
        growth = last["rss_bytes"] / first["rss_bytes"] - 1
        ranks.append({
            "rank": rank,
            "stage": trainer.strategy.layout.stage(rank),
            "samples": {str(step): sample for step, sample in sorted(samples.items())},
            "rss_growth": growth,
            "holds": growth <= RSS_LIMIT
            and last["threads"] <= first["threads"]
            and last["open_files"] <= first["open_files"],
        })
    seconds = sampler.gathered[0][steps]["seconds"] - sampler.gathered[0][reference]["seconds"]
    return {
        "steps": steps,
        "stages": stages,
        "stall_watchdog": stall_watchdog,
        "reference_step": reference,
        "seconds_per_step": seconds / (steps - reference),
        "ranks": ranks,
        "holds": all(rank["holds"] for rank in ranks),
    }


def markdown(result: dict[str, Any]) -> str:
    """One row per rank: memory, threads and open files at the reference step and at the last step."""
    reference, steps = str(result["reference_step"]), str(result["steps"])
    lines = [
        f"| stage (rank) | RSS at step {reference} | RSS at step {steps} | change | threads {reference} → {steps}"
        f" | open files {reference} → {steps} | holds |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for rank in sorted(result["ranks"], key=lambda r: r["stage"]):
        first, last = rank["samples"][reference], rank["samples"][steps]
        lines.append(
            f"| {rank['stage']} ({rank['rank']}) | {first['rss_bytes'] / 2**20:.1f} MiB | {last['rss_bytes'] / 2**20:.1f}"
            f" MiB | {rank['rss_growth']:+.2%} | {first['threads']} → {last['threads']}"
            f" | {first['open_files']} → {last['open_files']} | {'yes' if rank['holds'] else 'no'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None, help="write the result (rank 0) to this file")
    parser.add_argument("--no-stall-watchdog", action="store_true", help="run with GPipeStrategy(stall_watchdog=False)")
    args = parser.parse_args(argv)
    # The default launcher re-runs this script for the other ranks, with this process's environment.
    if _DIRECTORY_VARIABLE not in os.environ:
        os.environ[_DIRECTORY_VARIABLE] = tempfile.mkdtemp(prefix="lightning_pipe_soak")
    directory = Path(os.environ[_DIRECTORY_VARIABLE])
    result = soak(args.steps, args.stages, directory, stall_watchdog=not args.no_stall_watchdog)
    if not result:  # not global rank 0
        return 0
    shutil.rmtree(directory, ignore_errors=True)
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    watchdog = "on" if result["stall_watchdog"] else "off"
    print(f"{args.steps} steps on {args.stages} stages, {1e3 * result['seconds_per_step']:.1f} ms/step, stall watchdog"
          f" {watchdog}")
    print(markdown(result))
    return 0 if result["holds"] else 1


if __name__ == "__main__":
    sys.exit(main())
