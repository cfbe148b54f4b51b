"""The pipeline bubble: measured idle fraction of each step against GPipe's ``(S - 1) / (M + S - 1)``.

Two stages of equal blocks (2 × (Linear(W, W) + ReLU) each, He-initialised: :func:`stack.he_block`), one compute
thread per process, ``checkpoint="never"``.
For each micro-batch count M the strategy logs ``pipeline/bubble_fraction`` every step: the share of the step's
compute window (first forward to last backward, on any stage) that stages spend outside forward and backward,
averaged over stages. Communication, the loss and Python between micro-batches count as bubble, so the measured
fraction sits above the formula, which assumes free communication.

``python benchmarks/bench_bubble.py docs/images/timeline.png`` also traces one step at M=4 and draws it.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger
from torch import Tensor, nn

from launch import launch
from lightning_pipe import GPipeStrategy
from lightning_pipe.schedule import ideal_bubble_fraction
from report import markdown_table
from stack import he_block, repeated_batch_loader
from timing import StepEnds

NUM_STAGES = 2
MICRO_BATCHES = (1, 2, 4, 8)
TIMELINE_MICRO_BATCHES = 4


def sizes(quick: bool) -> dict[str, Any]:
    if quick:
        return {"width": 64, "blocks": 4, "batch": 32, "steps": 4, "micro_batches": list(MICRO_BATCHES)}
    return {"width": 512, "blocks": 8, "batch": 256, "steps": 12, "micro_batches": list(MICRO_BATCHES)}


def run(quick: bool) -> dict[str, Any]:
    spec = sizes(quick)
    answer = launch("bench_bubble", "measure", NUM_STAGES, spec)[0]
    rows = []
    for m, result in zip(spec["micro_batches"], answer["results"]):
        ideal = ideal_bubble_fraction(NUM_STAGES, m)
        rows.append([m, f"{ideal:.3f}", f"{result['bubble_fraction']:.3f}", f"{result['bubble_fraction'] - ideal:+.3f}",
                     f"{1e3 * result['step_s']:.1f}"])
    table = markdown_table(
        ["M", "formula (S-1)/(M+S-1)", "measured bubble (median)", "measured - formula", "step (ms, median)"], rows
    )
    markdown = (
        f"{spec['blocks']} blocks of 2 × (Linear({spec['width']}, {spec['width']}) + ReLU), batch {spec['batch']},"
        f" {NUM_STAGES} stages of equal blocks, `checkpoint=\"never\"`, one thread per process; median over the"
        f" steps of one fit of {spec['steps']} steps per M (the first step dropped). The measured bubble is"
        " `pipeline/bubble_fraction` as the strategy logs it: the idle share of each step's compute window (first"
        " forward to last backward on any stage), averaged over stages; sends, receives, the loss and the Python"
        " between micro-batches count as idle.\n\n"
        f"{table}"
    )
    return {"title": "Pipeline bubble", "markdown": markdown, "data": {**spec, **answer}}


# ---- the worker (runs on every rank, through benchmarks/worker.py) ---------------------------------------------


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


def main(out: Path) -> None:
    from lightning_pipe.trace import render_png

    spec = {**sizes(False), "steps": 4}
    trace = launch("bench_bubble", "trace_one_step", NUM_STAGES, spec)[0]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(trace))
    step = trace["otherData"]["steps"][0]
    render_png(
        trace, out,
        title=f"GPipe, {NUM_STAGES} stages, M={TIMELINE_MICRO_BATCHES}, one traced training step on CPU: bubble"
        f" {step['bubble_fraction']:.2f} measured, {step['ideal_bubble_fraction']:.2f} by the formula",
    )
    print(f"wrote {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
