"""Worker: a timm-shaped ResNet (tests/helpers/timm_models.py) trained with the gpipe strategy and no argument naming
its blocks, its data handed to ``trainer.fit`` in each way Lightning takes it; several runs in one launch.

Usage: python region_choice_worker.py SPEC.json
(SPEC: {"devices": N, "out": DIR, "steps": S, "runs": [{"name": ..., "data": "loader" | "datamodule",
"strategy": {...}}, ...]})
Each run writes DIR/NAME/rank{R}.pt (the model's state dict after fit) and DIR/NAME/rank{R}.json (the loss of every
step, as the step returned it, and the pipelined region's blocks).
"""

import json
import sys
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningDataModule, Trainer, seed_everything

import lightning_pipe
from helpers.process_exit import skip_the_last_collection
from helpers.recording import StepLossRecording
from helpers.timm_models import TimmResNetClassifier, timm_resnet_loader

skip_the_last_collection()  # in every process that runs this script, ranks included


class StepLosses(StepLossRecording, Callback):
    pass


class ImagesDataModule(LightningDataModule):
    """The same batches from a DataModule whose loader exists only once ``setup`` has run (as most do)."""

    def setup(self, stage: str) -> None:
        self.loader = timm_resnet_loader()

    def train_dataloader(self):
        return self.loader


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    for run in spec["runs"]:
        out = Path(spec["out"]) / run["name"]
        seed_everything(0)
        model = TimmResNetClassifier()
        losses = StepLosses()
        trainer = Trainer(
            strategy=lightning_pipe.GPipeStrategy(**run.get("strategy", {})), accelerator="cpu",
            devices=spec["devices"], max_steps=spec["steps"], logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[losses],
        )
        if run["data"] == "datamodule":
            trainer.fit(model, datamodule=ImagesDataModule())
        else:
            trainer.fit(model, timm_resnet_loader())
        out.mkdir(parents=True, exist_ok=True)
        rank = trainer.global_rank
        torch.save(model.state_dict(), out / f"rank{rank}.pt")
        region = trainer.strategy._pipeline.region
        (out / f"rank{rank}.json").write_text(json.dumps({"losses": losses.losses, "region": list(region.names)}))


if __name__ == "__main__":
    main(sys.argv[1])
