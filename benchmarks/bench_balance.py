"""Balancing: step time with ``balance="time"`` against ``balance="uniform"`` on a model whose first half costs 7x.

The pipelined ``nn.Sequential`` holds ``2k`` blocks: ``k`` heavy blocks of 7 × (Linear(W, W) + ReLU), then ``k``
light blocks of 1 × (Linear(W, W) + ReLU), He-initialised: real matrix products, no sleeping. Split by layer count,
stage 0 gets all heavy blocks, 7/8 of the work; the best contiguous split is about 1.75 times faster in theory.
Two stages, one compute thread per process; the two modes take turns (``rounds`` fits of each, after one
unmeasured pair), and a step's time is the interval between consecutive step ends on global rank 0, the first of
each fit dropped. The speedup is the median over rounds of uniform's median step over time's, so that a change in
the machine's load between rounds cancels out.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn
from torch.utils.data import DataLoader

from launch import launch
from lightning_pipe import GPipeStrategy
from lightning_pipe.balance import min_max_partition, stage_costs
from lightning_pipe.config import PipelineParallelConfig, ranges_from_sizes
from report import markdown_table, verdict
from stack import RepeatedBatch, he_block
from timing import StepEnds

NUM_STAGES = 2
HEAVY_FACTOR = 7
TARGET_SPEEDUP = 1.4
MODES = ("uniform", "time")


def sizes(quick: bool) -> dict[str, int]:
    if quick:
        return {"width": 64, "blocks_per_half": 4, "batch": 32, "micro_batches": 4, "steps": 4, "rounds": 1}
    return {"width": 256, "blocks_per_half": 16, "batch": 128, "micro_batches": 8, "steps": 10, "rounds": 5}


def run(quick: bool) -> dict[str, Any]:
    spec = sizes(quick)
    load_before = os.getloadavg()[0]
    answer = launch("bench_balance", "measure", NUM_STAGES, spec)[0]
    load = max(load_before, os.getloadavg()[0])
    speedup = answer["speedup"]
    busy_speedup = answer["uniform"]["slowest_busy_s"] / answer["time"]["slowest_busy_s"]
    k = spec["blocks_per_half"]
    costs = [float(HEAVY_FACTOR)] * k + [1.0] * k
    uniform_ranges = PipelineParallelConfig(NUM_STAGES, spec["micro_batches"]).split_into_stages(2 * k)
    best_ranges = ranges_from_sizes(min_max_partition(costs, NUM_STAGES))
    theory = max(stage_costs(costs, uniform_ranges)) / max(stage_costs(costs, best_ranges))
    rows = [
        [
            f'`"{mode}"`',
            " + ".join(str(stop - start) for start, stop in answer[mode]["ranges"]),
            f"{answer[mode]['imbalance']:.2f}",
            f"{1e3 * answer[mode]['slowest_busy_s']:.1f}",
            f"{1e3 * answer[mode]['step_s']:.1f}",
        ]
        for mode in MODES
    ]
    headers = ["balance", "blocks per stage", "measured imbalance", "slowest stage busy (ms)", "step (ms, median)"]
    table = markdown_table(headers, rows)
    markdown = (
        f"{k} heavy blocks (7 × (Linear({spec['width']}, {spec['width']}) + ReLU)) then {k} light blocks (1 ×),"
        " He-initialised (with the default initialisation, gradients through this many ReLU layers become denormal"
        f" floats, which the CPU computes many times slower), batch"
        f" {spec['batch']}, {NUM_STAGES} stages, M={spec['micro_batches']}, `checkpoint=\"except_last\"`, SGD; one"
        f" thread per process; median over {answer['measured_steps']} steps of each mode from {spec['rounds']}"
        " alternating fits"
        f" of {spec['steps']} steps (the first step of each fit and one warm-up pair dropped); speedup: median over"
        " rounds of the ratio of the two modes' median steps. Measured imbalance: slowest stage's busy time"
        " (forwards + backwards) over the mean, from the stage summary; slowest stage busy: its median over the"
        " steps. The split by block FLOPs would be"
        f" {theory:.2f}× faster than the uniform one (bubble ignored).\n\n"
        f"{table}\n\n"
        f"Slowest stage's busy time, uniform over time: {busy_speedup:.2f}×. Load average during the run: up to"
        f" {load:.1f} on {os.cpu_count()} cores; two stages overlap only when two cores are free, so a loaded"
        " machine shrinks the step-time gain, not the busy-time one.\n\n"
        + verdict(
            f'`balance="time"` ≥ {TARGET_SPEEDUP}× faster per step than `"uniform"`',
            speedup >= TARGET_SPEEDUP,
            f"{speedup:.2f}×",
        )
    )
    data = {**spec, **answer, "theoretical_speedup": theory, "busy_speedup": busy_speedup, "load_average": load}
    return {"title": "Balancing by measured time", "markdown": markdown, "data": data}


# ---- the worker (runs on every rank, through benchmarks/worker.py) ---------------------------------------------


class SkewedModel(LightningModule):
    """Heavy blocks first, light blocks second, in ``self.blocks``; an MSE loss; a sample for profiling."""

    def __init__(self, width: int, blocks_per_half: int, batch: int) -> None:
        super().__init__()
        heavy = [he_block(width, HEAVY_FACTOR) for _ in range(blocks_per_half)]
        light = [he_block(width, 1) for _ in range(blocks_per_half)]
        self.blocks = nn.Sequential(*heavy, *light)
        self.example_input_array = torch.randn(batch, width)

    def forward(self, x: Tensor) -> Tensor:
        return self.blocks(x)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, target = batch
        return F.mse_loss(self(x), target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-4)


def _fit(spec: dict[str, Any], mode: str) -> tuple[list[float], dict[str, Any]]:
    """One fit: the intervals between step ends (the first dropped), and the split with its measured balance."""
    torch.manual_seed(0)
    model = SkewedModel(spec["width"], spec["blocks_per_half"], spec["batch"])
    batch = (torch.randn(spec["batch"], spec["width"]), torch.zeros(spec["batch"], spec["width"]))
    loader = DataLoader(RepeatedBatch(batch, spec["steps"]), batch_size=None)
    clock = StepEnds()
    # A logger at every step: the strategy then measures every step's busy time per stage (one small gather).
    strategy = GPipeStrategy(num_micro_batches=spec["micro_batches"], balance=mode)
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=dist.get_world_size(), max_steps=spec["steps"],
        logger=CSVLogger(f"logs_{mode}"), log_every_n_steps=1,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, callbacks=[clock],
    )
    dist.barrier()
    trainer.fit(model, loader)
    summary = strategy.stage_summary()
    split = {
        "ranges": [[row.layers.start, row.layers.stop] for row in summary.rows],
        "imbalance": summary.imbalance,
        "slowest_busy_s": statistics.median([max(observed.busy_seconds) for observed in clock.observed[1:]]),
    }
    return clock.intervals(), split


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    steps: dict[str, list[float]] = {mode: [] for mode in MODES}
    ratios: list[float] = []  # per round: uniform's median step over time's, robust to the machine's load drifting
    splits: dict[str, dict[str, Any]] = {}
    for round_index in range(1 + spec["rounds"]):
        medians = {}
        for mode in MODES:
            intervals, splits[mode] = _fit(spec, mode)
            medians[mode] = statistics.median(intervals)
            if round_index > 0:
                steps[mode] += intervals
        if round_index > 0:
            ratios.append(medians["uniform"] / medians["time"])
    return {
        **{mode: {"step_s": statistics.median(steps[mode]), **splits[mode]} for mode in MODES},
        "measured_steps": len(steps["uniform"]),
        "round_speedups": ratios,
        "speedup": statistics.median(ratios),
    }
