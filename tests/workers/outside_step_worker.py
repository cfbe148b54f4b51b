"""Worker: a callback calls the model outside a step, on every rank or (wrongly) on rank 0 only.

Usage: python outside_step_worker.py SPEC.json   (SPEC: {"out": DIR, "where": "everywhere" | "rank_zero"})
"""

import json
import sys
from datetime import timedelta
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

import lightning_pipe
from helpers.models import PipeClassifier, loaders
from lightning_pipe.execution import runtime as runtime_module
from helpers.process_exit import skip_the_last_collection

skip_the_last_collection()  # in every process that runs this script, ranks included

runtime_module._OUTSIDE_STEP_TIMEOUT = timedelta(seconds=5)  # the test need not wait the default minute


class CallsTheModel(Callback):
    def __init__(self, out: Path, rank_zero_only: bool) -> None:
        self.out, self.rank_zero_only = out, rank_zero_only

    def on_train_start(self, trainer, pl_module):
        if self.rank_zero_only and not trainer.is_global_zero:
            return
        x = torch.linspace(-1, 1, 5 * 12).view(5, 3, 4)
        torch.save(pl_module(x), self.out / f"output_rank{trainer.global_rank}.pt")


def main(spec_path):
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    seed_everything(0)
    trainer = Trainer(strategy=lightning_pipe.GPipeStrategy(), accelerator="cpu", devices=2, max_steps=1,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      callbacks=[CallsTheModel(out, spec["where"] == "rank_zero")])
    trainer.fit(PipeClassifier(), *loaders(32, 16, 16))


if __name__ == "__main__":
    main(sys.argv[1])
