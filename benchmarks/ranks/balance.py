"""One rank of the balancing section (:mod:`sections.bench_balance`): fits of the skewed model with each balance
mode, and the heavy half's compute time alone and side by side, in rounds."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn

from harness.rank import run_rank
from harness.stack import he_block, repeated_batch_loader
from harness.summarize import median
from harness.timing import StepEnds, timed, timed_on
from lightning_pipe import GPipeStrategy

HEAVY_FACTOR = 7
MODES = ("uniform", "time")

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


def _fit(spec: dict[str, Any], mode: str) -> dict[str, Any]:
    """One fit: the intervals between step ends (the first dropped) and their median, the split with its measured
    balance, and the median over steps of the slowest and the least busy stage's busy time (forwards + backwards)."""
    torch.manual_seed(0)
    model = SkewedModel(spec["width"], spec["blocks_per_half"], spec["batch"])
    loader = repeated_batch_loader(spec["batch"], spec["width"], spec["steps"])
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
    intervals = clock.intervals()
    return {
        "intervals": intervals,
        "ranges": [[row.blocks.start, row.blocks.stop] for row in summary.rows],
        "imbalance": summary.imbalance,
        "step_s": median(intervals),
        "slowest_busy_s": median([max(observed.busy_seconds) for observed in clock.observed[1:]]),
        "least_busy_s": median([min(observed.busy_seconds) for observed in clock.observed[1:]]),
    }


def _heavy_half(spec: dict[str, Any]) -> Callable[[], None]:
    """Forward + backward of the heavy blocks over one step's micro-batches: what the uniform split's stage 0
    computes in a step (re-computation aside)."""
    torch.manual_seed(0)
    heavy = nn.Sequential(*(he_block(spec["width"], HEAVY_FACTOR) for _ in range(spec["blocks_per_half"])))
    micro_batches = torch.randn(spec["batch"], spec["width"]).chunk(spec["micro_batches"])

    def forward_backward() -> None:
        for x in micro_batches:
            heavy(x).square().mean().backward()

    return forward_backward


def _contention(work: Callable[[], None]) -> dict[str, float]:
    """``work`` on global rank 0 alone (the other rank waiting) and on both ranks at once (the slower one), twice each
    in the order alone, both, both, alone, so that a steady drift in the machine's load cancels."""
    alone = [timed_on(0, work)]
    side_by_side = [timed(work), timed(work)]
    alone.append(timed_on(0, work))
    return {"alone_s": statistics.mean(alone), "side_by_side_s": statistics.mean(side_by_side)}


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Per measured round: each mode's fit (see :func:`_fit`) and the heavy half's time alone and side by side."""
    heavy_half = _heavy_half(spec)
    rounds: list[dict[str, Any]] = []
    for round_index in range(1 + spec["rounds"]):
        # The modes swap places every round and the contention is measured between them: load drifting within a
        # round then weighs on both modes alike.
        first, second = MODES if round_index % 2 == 0 else MODES[::-1]
        fits = {first: _fit(spec, first)}
        contention = _contention(heavy_half)
        fits[second] = _fit(spec, second)
        if round_index > 0:  # the first round warms up
            rounds.append({**contention, **fits})
    return {"per_round": rounds}


if __name__ == "__main__":
    run_rank(measure)
