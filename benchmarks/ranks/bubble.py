"""One rank of the pipeline bubble section (:mod:`sections.bench_bubble`): a fit per micro-batch count, or one
traced step for the timeline picture."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn

from harness.rank import run_rank
from harness.stack import he_block, repeated_batch_loader
from harness.timing import StepEnds
from lightning_pipe import GPipeStrategy

TIMELINE_MICRO_BATCHES = 4

class EvenModel(LightningModule):
    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(he_block(width, 2) for _ in range(blocks)))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, target = batch
        return F.mse_loss(self.blocks(x), target)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-4)


def _fit(spec: dict[str, Any], m: int, trace_steps: list[int]) -> tuple[StepEnds, Path]:
    torch.manual_seed(0)
    loader = repeated_batch_loader(spec["batch"], spec["width"], spec["steps"])
    clock = StepEnds()
    trace_dir = Path(f"trace_m{m}")
    trainer = Trainer(
        strategy=GPipeStrategy(num_micro_batches=m, checkpoint="never", trace_steps=trace_steps, trace_dir=trace_dir),
        accelerator="cpu", devices=dist.get_world_size(), max_steps=spec["steps"],
        logger=CSVLogger(f"logs_m{m}"), log_every_n_steps=1,  # a logger: the bubble is measured at every logged step
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, callbacks=[clock],
    )
    dist.barrier()
    trainer.fit(EvenModel(spec["width"], spec["blocks"]), loader)
    return clock, trace_dir / "gpipe_trace.json"


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    results = []
    for m in spec["micro_batches"]:
        clock, _ = _fit(spec, m, [])
        bubbles = [observed.bubble_fraction for observed in clock.observed]
        results.append(
            {"bubble_fraction": statistics.median(bubbles[1:]), "step_s": statistics.median(clock.intervals()),
             "bubbles": bubbles}
        )
    return {"results": results}


def trace_one_step(spec: dict[str, Any]) -> dict[str, Any]:
    """A traced step (the third) at M=4; the trace as a dict, from global rank 0."""
    _, trace_path = _fit(spec, TIMELINE_MICRO_BATCHES, [2])
    return json.loads(trace_path.read_text()) if dist.get_rank() == 0 else {}


if __name__ == "__main__":
    run_rank(measure, trace_one_step)
