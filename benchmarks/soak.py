"""Soak: a long CPU run under ``Trainer(strategy="gpipe")`` must not grow in memory, threads or open files.

Usage::

    python benchmarks/soak.py                                # 2,000 steps on 4 stages (the recorded run)
    python benchmarks/soak.py --steps 200 --stages 2 --json soak.json
    python benchmarks/soak.py --no-stall-watchdog            # the same run with the stall watchdog off, to compare
    python benchmarks/soak.py --compare-watchdog 8 --steps 96  # 8 pairs of fits, watchdog on and off taking turns

Every rank samples its own resident memory (``VmRSS``), thread count and open file descriptors from ``/proc/self``
at fixed steps; rank 0 gathers the samples and prints one table row per rank. The run holds what long trainings
hold: epochs of 16 steps with a validation loop at each end, a torchmetrics metric logged every step, a CSV logger
(with the logged bubble fraction) and a ``ModelCheckpoint`` writing ``last.ckpt`` every 10 epochs. The check: at
the last step each rank's resident memory is within 5% of what it was at the first sampled step after warm-up
(step 200 of 2,000), and its threads and open files are no more than then.

``--compare-watchdog PAIRS`` measures the stall watchdog's cost on this model instead: in one launch, fits of
``--steps`` steps with the watchdog on and off take turns (on, off, off, on, ...: drift in the machine's load falls on
both alike); a fit's time per step is the mean of its step intervals within an epoch (the validation loop between
epochs left out, the first epoch too: its first steps compile and allocate), the cost the median over pairs of the
on / off ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
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


class StepTimes(Callback):
    """When each training step ended, by epoch: wall-clock time, and the CPU time of this process (every thread's);
    every rank's CPU time per step gathered at the end."""

    def __init__(self) -> None:
        self.ends: dict[int, list[tuple[float, float]]] = {}
        self.cpu_per_rank: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.ends.setdefault(trainer.current_epoch, []).append((time.perf_counter(), time.process_time()))

    def on_train_end(self, trainer, pl_module):
        gathered: list[Any] = [None] * trainer.world_size
        torch.distributed.all_gather_object(gathered, self.per_step(1))
        self.cpu_per_rank = gathered

    def per_step(self, clock: int) -> float:
        """The mean interval between step ends within an epoch, the first epoch left out: wall-clock seconds
        (``clock=0``) or this process's CPU seconds (``clock=1``)."""
        intervals = [b[clock] - a[clock] for epoch, ends in self.ends.items() if epoch > 0 for a, b in zip(ends, ends[1:])]
        return sum(intervals) / len(intervals)


def soak_trainer(steps: int, stages: int, directory: Path, stall_watchdog: bool, callbacks: list[Callback]) -> Trainer:
    """The soak's run: its logger, checkpoints every 10 epochs and ``callbacks``."""
    return Trainer(
        strategy=lightning_pipe.GPipeStrategy(num_micro_batches=8, stall_watchdog=stall_watchdog),
        accelerator="cpu",
        devices=stages,
        max_steps=steps,
        logger=CSVLogger(directory, name="soak"),
        log_every_n_steps=8,
        callbacks=[*callbacks, ModelCheckpoint(dirpath=directory / "ckpt", save_last=True, every_n_epochs=10)],
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def fit(trainer: Trainer) -> None:
    trainer.fit(
        Classifier(),
        DataLoader(dataset(TRAIN_SAMPLES, 0), batch_size=BATCH),
        DataLoader(dataset(VAL_SAMPLES, 1), batch_size=BATCH),
    )


def compare_watchdog(pairs: int, steps: int, stages: int, directory: Path) -> dict[str, Any]:
    """``pairs`` pairs of fits of ``steps`` steps, the stall watchdog on and off taking turns (see the module); on
    global rank 0 each fit's seconds per step and the cost, else ``{}``."""
    wall: dict[bool, list[float]] = {True: [], False: []}
    cpu: dict[bool, list[float]] = {True: [], False: []}  # every rank's CPU seconds per step, summed
    for index in range(2 * pairs):
        watchdog = index % 4 in (0, 3)  # on, off, off, on, ...
        seed_everything(0)
        times = StepTimes()
        trainer = soak_trainer(steps, stages, directory / str(index), watchdog, [times])
        fit(trainer)
        wall[watchdog].append(times.per_step(0))
        cpu[watchdog].append(sum(times.cpu_per_rank))
    if not trainer.is_global_zero:
        return {}
    return {
        "steps": steps, "stages": stages, "pairs": pairs, "on_s": wall[True], "off_s": wall[False],
        "on_cpu_s": cpu[True], "off_cpu_s": cpu[False],
        "cost": statistics.median(a / b for a, b in zip(wall[True], wall[False])) - 1,
        "cpu_cost": statistics.median(a / b for a, b in zip(cpu[True], cpu[False])) - 1,
        "load_average": list(os.getloadavg()),
    }


def soak(steps: int, stages: int, directory: Path, stall_watchdog: bool = True) -> dict[str, Any]:
    """Train for ``steps`` steps on ``stages`` stages (the stall watchdog on, by default, as in any run); on global
    rank 0 the per-rank samples and the verdicts."""
    reference = steps // 10  # after warm-up: allocator pools, the first epochs and checkpoints are in place
    sample_steps = sorted({1, reference, *range(reference, steps + 1, max(1, steps // 10)), steps})
    seed_everything(0)
    sampler = ResourceSampler(sample_steps)
    trainer = soak_trainer(steps, stages, directory, stall_watchdog, [sampler])
    fit(trainer)
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
    parser.add_argument("--compare-watchdog", type=int, metavar="PAIRS", default=None,
                        help="measure the stall watchdog's cost: PAIRS pairs of fits of --steps steps, on and off")
    args = parser.parse_args(argv)
    # The default launcher re-runs this script for the other ranks, with this process's environment.
    if _DIRECTORY_VARIABLE not in os.environ:
        os.environ[_DIRECTORY_VARIABLE] = tempfile.mkdtemp(prefix="lightning_pipe_soak")
    directory = Path(os.environ[_DIRECTORY_VARIABLE])
    if args.compare_watchdog is not None:
        return _report_comparison(compare_watchdog(args.compare_watchdog, args.steps, args.stages, directory),
                                  directory, args.json)
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


def _report_comparison(result: dict[str, Any], directory: Path, json_path: Path | None) -> int:
    if not result:  # not global rank 0
        return 0
    shutil.rmtree(directory, ignore_errors=True)
    if json_path is not None:
        json_path.write_text(json.dumps(result, indent=2) + "\n")
    on, off, on_cpu, off_cpu = (" ".join(f"{1e3 * s:.1f}" for s in result[key])
                                for key in ("on_s", "off_s", "on_cpu_s", "off_cpu_s"))
    print(f"{result['pairs']} pairs of {result['steps']}-step fits on {result['stages']} stages, the stall watchdog on"
          f" and off (medians of the pairs' ratios). Wall-clock ms/step on: {on}; off: {off}; cost {result['cost']:+.2%}."
          f" CPU ms/step (all ranks) on: {on_cpu}; off: {off_cpu}; cost {result['cpu_cost']:+.2%}. Load average"
          f" {', '.join(f'{v:.2f}' for v in result['load_average'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
