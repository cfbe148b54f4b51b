"""Worker: short `Trainer.fit` runs with each balance mode and with tracing, in one launch; results written per rank.

Usage: python balance_trace_worker.py SPEC.json
SPEC: {"devices": N, "out": DIR, "runs": [{"name": ..., "balance": ..., "sample": bool, "trace_steps": [...],
"num_micro_batches": M, "checkpoint": ..., "csv_logger": bool, "one_host_per_rank": bool, "strategy": {...}}, ...]}
Each run writes DIR/NAME/rank{R}.json: the split this rank applied, its stage summary and the logged bubble
fractions; a run with trace_steps also writes its trace to DIR/NAME/gpipe_trace.json (from global rank 0).
"""

import json
import os
import sys
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.loggers import CSVLogger

import lightning_pipe
from helpers.models import PipeClassifier, loaders
from lightning_pipe.trace import tracer
from helpers.process_exit import skip_the_last_collection

skip_the_last_collection()  # in every process that runs this script, ranks included


class BubbleRecorder(Callback):
    def __init__(self) -> None:
        self.bubbles: list[float] = []
        self.ideal: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        observed = trainer.strategy.last_observed_step
        if observed is not None and observed.step == trainer.global_step - 1:  # this batch's step was logged
            self.bubbles.append(observed.bubble_fraction)
            self.ideal.append(observed.ideal_bubble_fraction)


def main(spec_path):
    spec = json.loads(Path(spec_path).read_text())
    for run in spec["runs"]:
        out = Path(spec["out"]) / run["name"]
        # Each rank pretends to be on its own host: clocks are then aligned by ping-pong, as across machines.
        host = f"host{os.environ.get('LOCAL_RANK', '0')}" if run.get("one_host_per_rank") else os.uname().nodename
        tracer.socket.gethostname = lambda host=host: host
        seed_everything(0)
        model = PipeClassifier(depth=run.get("depth", 8))
        if run.get("example_input_array", True):
            model.example_input_array = torch.randn(16, 3, 4)
        train, val = loaders(run.get("train_samples", 32), 16, 16)
        strategy = lightning_pipe.GPipeStrategy(
            num_micro_batches=run.get("num_micro_batches", 4),
            checkpoint=run.get("checkpoint", "except_last"),
            balance=run.get("balance"),
            sample=torch.randn(8, 3, 4) if run.get("sample") else None,
            trace_steps=run.get("trace_steps", ()),
            trace_dir=out,
            **run.get("strategy", {}),  # a schedule, virtual stages
        )
        recorder = BubbleRecorder()
        trainer = Trainer(
            strategy=strategy, accelerator="cpu", devices=spec["devices"], max_epochs=1,
            logger=CSVLogger(out, name="csv", version=0) if run.get("csv_logger") else False, log_every_n_steps=1,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            callbacks=[recorder], limit_val_batches=0,
        )
        trainer.fit(model, train, val)
        summary = strategy.stage_summary()
        out.mkdir(parents=True, exist_ok=True)
        result = {
            "ranges": [[r.start, r.stop] for r in strategy._pipeline.plan.ranges],
            "method": strategy._pipeline.plan.method,
            "costs": strategy._pipeline.plan.costs,
            "summary": str(summary),
            "imbalance": summary.imbalance,
            "rows": [{"stage": row.stage, "rank": row.rank, "parameters": row.parameters} for row in summary.rows],
            "bubbles": recorder.bubbles,
            "ideal": recorder.ideal,
        }
        (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
