"""What a run measured, and the table that compares the jobs of a sweep.

``RunReport`` (a Lightning callback) measures throughput and, on every rank, the parameters and peak memory of
that rank's stage; rank 0 prints the summary and writes ``report.json`` into the run's directory.
``SweepComparison`` (a Hydra callback) reads every job's ``report.json`` at the end of a multirun and writes
``comparison.csv`` and ``comparison.md`` into the sweep directory.
"""

from __future__ import annotations

import csv
import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from hydra.experimental.callback import Callback as HydraCallback
from lightning.pytorch import Callback, LightningModule, Trainer
from omegaconf import DictConfig, OmegaConf

REPORT = "report.json"


class RunReport(Callback):
    """Samples per second over the training batches (the first, warm-up batch left out), the final losses, the
    schedule, the measured pipeline bubble beside the schedule's ideal one, and per stage the parameters it holds and
    its peak memory (resident set size; on CUDA also the allocator's peak)."""

    def __init__(self, out_dir: str | Path) -> None:
        self.out_dir = Path(out_dir)
        self._batch_start = 0.0
        self._seconds = 0.0
        self._samples = 0
        self._steps = 0
        self._started = time.perf_counter()

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._started = time.perf_counter()

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._batch_start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._steps += 1
        if self._steps > 1:  # the first step pays for warm-up (allocations, first messages)
            self._seconds += time.perf_counter() - self._batch_start
            self._samples += len(batch[0])

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        stages = _gather(self._stage_record(trainer, pl_module))
        if trainer.global_rank != 0:
            return
        strategy = trainer.strategy
        config = getattr(strategy, "config", None)
        metrics = {key: float(value) for key, value in trainer.callback_metrics.items()}
        observed = getattr(strategy, "last_observed_step", None)  # the strategy's bubble measurement, if any
        num_stages = config.num_stages if config else 1
        replicas = max(1, trainer.world_size // num_stages)  # each replica of the pipeline trains its own batches
        summary = strategy.stage_summary() if hasattr(strategy, "stage_summary") else None  # names the schedule
        report = {
            "num_stages": num_stages,
            "replicas": replicas,
            "num_micro_batches": config.num_micro_batches if config else 1,
            "schedule": summary.schedule if summary else None,
            "accelerator": type(trainer.accelerator).__name__.replace("Accelerator", "").lower(),
            "steps": trainer.global_step,
            "samples_per_second": replicas * self._samples / self._seconds if self._seconds else None,
            "val_loss": metrics.get("val_loss"),
            "train_loss": metrics.get("train_loss"),
            "fit_seconds": time.perf_counter() - self._started,
            "bubble_fraction": observed.bubble_fraction if observed else None,
            "ideal_bubble_fraction": summary.ideal_bubble if summary else None,  # the schedule's, at M micro-batches
            "stages": sorted(stages, key=lambda record: record["stage"]),
        }
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / REPORT).write_text(json.dumps(report, indent=2))
        print(format_report(report), flush=True)

    def _stage_record(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        record = {
            "stage": getattr(trainer.strategy, "stage_index", 0),
            "rank": trainer.global_rank,
            "parameters": sum(p.numel() for p in pl_module.parameters()),
            "peak_rss_mb": _peak_rss_mb(),
        }
        if pl_module.device.type == "cuda":
            record["peak_cuda_mb"] = torch.cuda.max_memory_allocated(pl_module.device) / 2**20
        return record


def format_report(report: dict[str, Any]) -> str:
    """The end-of-run summary: final validation loss, throughput, and a row per stage."""
    throughput = report["samples_per_second"]
    lines = [
        f"Summary: {report['num_stages']} stage(s) x {report['replicas']} replica(s),"
        f" {report['num_micro_batches']} micro-batches per batch, schedule {report['schedule'] or 'n/a'},"
        f" {report['steps']} steps on {report['accelerator']}",
        f"  final val_loss    {_number(report['val_loss'], '.4f')}"
        f"   (train_loss {_number(report['train_loss'], '.4f')})",
        f"  throughput        {_number(throughput, '.1f')} samples/s",
        f"  fit time          {report['fit_seconds']:.1f} s",
    ]
    if report["bubble_fraction"] is not None:  # measured on the logged steps of a multi-stage pipeline
        lines.insert(3, f"  bubble            {report['bubble_fraction']:.0%} of the last logged step"
                        f" (ideal {report['ideal_bubble_fraction']:.0%})")
    cuda = any("peak_cuda_mb" in stage for stage in report["stages"])
    header = "  stage  rank  parameters  peak RSS (MB)" + ("  peak CUDA (MB)" if cuda else "")
    lines.append(header)
    for stage in report["stages"]:
        row = f"  {stage['stage']:>5}  {stage['rank']:>4}  {stage['parameters']:>10,}  {stage['peak_rss_mb']:>13.0f}"
        if cuda:
            row += f"  {stage.get('peak_cuda_mb', 0.0):>14.0f}"
        lines.append(row)
    lines.append("  (parameters: the stage's blocks plus the modules every stage keeps a copy of)")
    return "\n".join(lines)


class SweepComparison(HydraCallback):
    """At the end of ``python examples/train.py -m ...``: a table with one row per job, as CSV and Markdown."""

    COLUMNS = (
        "job", "overrides", "stages", "replicas", "micro_batches", "schedule", "samples_per_s", "val_loss",
        "train_loss", "bubble", "ideal_bubble", "max_peak_rss_mb", "peak_rss_mb_per_stage", "fit_s",
    )

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        jobs = _job_dirs(sweep_dir)
        if not jobs:
            return
        overrides = [_overrides(job) for job in jobs]
        shared = [item for item in overrides[0] if all(item in other for other in overrides[1:])]
        rows = [self._row(job, [item for item in own if item not in shared]) for job, own in zip(jobs, overrides)]
        with open(sweep_dir / "comparison.csv", "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=self.COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
        table = _markdown(rows, self.COLUMNS)
        if shared:
            table = f"Every job: `{' '.join(shared)}`\n\n{table}"
        (sweep_dir / "comparison.md").write_text(table + "\n")
        print(f"\nSweep comparison ({sweep_dir / 'comparison.md'}):\n{table}", flush=True)

    @staticmethod
    def _row(job_dir: Path, overrides: list[str]) -> dict[str, Any]:
        row: dict[str, Any] = {"job": job_dir.name, "overrides": " ".join(overrides)}
        report_file = job_dir / REPORT
        if not report_file.exists():  # the job failed before it finished training
            return {**row, "samples_per_s": "failed"}
        report = json.loads(report_file.read_text())
        peaks = [stage["peak_rss_mb"] for stage in report["stages"]]
        return {
            **row,
            "stages": report["num_stages"],
            "replicas": report.get("replicas", 1),
            "micro_batches": report["num_micro_batches"],
            "schedule": report.get("schedule") or "n/a",
            "samples_per_s": _number(report["samples_per_second"], ".1f"),
            "val_loss": _number(report["val_loss"], ".4f"),
            "train_loss": _number(report["train_loss"], ".4f"),
            "bubble": _number(report.get("bubble_fraction"), ".2f"),
            "ideal_bubble": _number(report.get("ideal_bubble_fraction"), ".2f"),
            "max_peak_rss_mb": f"{max(peaks):.0f}",
            "peak_rss_mb_per_stage": " / ".join(f"{peak:.0f}" for peak in peaks),
            "fit_s": f"{report['fit_seconds']:.1f}",
        }


def _overrides(job_dir: Path) -> list[str]:
    """The command-line overrides of one job, as Hydra recorded them."""
    path = job_dir / ".hydra" / "overrides.yaml"
    return [str(item) for item in OmegaConf.load(path)] if path.exists() else []


def _job_dirs(sweep_dir: Path) -> list[Path]:
    """The job directories of a sweep (Hydra names them 0, 1, 2, ...), in job order."""
    jobs = [path for path in sweep_dir.iterdir() if path.is_dir() and path.name.isdigit()]
    return sorted(jobs, key=lambda path: int(path.name))


def _gather(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's record on every rank (one record without a process group)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [record]
    records: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(records, record)
    return records


def _peak_rss_mb() -> float:
    """This process's peak resident set size so far (``ru_maxrss`` is in KiB on Linux and bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def _number(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def _markdown(rows: list[dict[str, Any]], columns: tuple[str, ...]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(" --- " for _ in columns) + "|"]
    lines += ["| " + " | ".join(str(row.get(column, "")) for column in columns) + " |" for row in rows]
    return "\n".join(lines)
