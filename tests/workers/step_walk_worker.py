"""Worker: the package's calls in one training step, recorded on every rank (see helpers/call_path.py).

Usage: python step_walk_worker.py SPEC.json   (SPEC: {"out": DIR, "schedules": ["gpipe", "1f1b"]})
Each schedule's fit (2 stages, 4 micro-batches) records its third step: DIR/SCHEDULE/rank{R}.json holds the stage,
whether it is the loss stage, and the recorded calls.
"""

import json
import sys
from pathlib import Path

from lightning.pytorch import Callback, Trainer, seed_everything

import lightning_pipe
from helpers.call_path import CallRecorder
from helpers.models import PipeClassifier, loaders
from helpers.process_exit import skip_the_last_collection

skip_the_last_collection()  # in every process that runs this script, ranks included

RECORDED_STEP = 2  # warm: the first steps check and cache what later steps reuse


class RecordsOneStep(Callback):
    def __init__(self, out: Path) -> None:
        self.out = out
        self.recorder: CallRecorder | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == RECORDED_STEP:
            self.recorder = CallRecorder()
            sys.setprofile(self.recorder)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.recorder is None:
            return
        sys.setprofile(None)
        strategy = trainer.strategy
        found = {"stage": strategy.stage_index, "loss_stage": strategy.stage_index == strategy.layout.loss_stage,
                 "nodes": self.recorder.nodes}
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(found))
        self.recorder = None


def main(spec_path):
    spec = json.loads(Path(spec_path).read_text())
    for schedule in spec["schedules"]:
        seed_everything(0)
        train, _ = loaders(64, 8, batch_size=16)
        trainer = Trainer(
            strategy=lightning_pipe.GPipeStrategy(num_micro_batches=4, schedule=schedule), accelerator="cpu",
            devices=2, max_steps=RECORDED_STEP + 1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[RecordsOneStep(Path(spec["out"], schedule))],
        )
        trainer.fit(PipeClassifier(), train)


if __name__ == "__main__":
    main(sys.argv[1])
