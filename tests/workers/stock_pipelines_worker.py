"""Worker: the stock models of tests/helpers/stock_models.py trained with the gpipe strategy, several in one launch.

Usage: python stock_pipelines_worker.py SPEC.json
(SPEC: {"devices": N, "out": DIR, "steps": S, "runs": [{"name": ..., "model": ..., "strategy": {...}}, ...]})
Each run writes DIR/NAME/rank{R}.pt (the model's state dict after fit) and DIR/NAME/rank{R}.json (per-step losses,
a run with ``drop_gradient_of`` is the negative control; with ``predict``, DIR/NAME/predictions.pt after fit; with
``save``, DIR/NAME/model.ckpt; with ``validate``, DIR/NAME/validated{R}.json, ``trainer.validate``'s metrics).
"""

import json
import sys
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything

import lightning_pipe
from helpers.negative_controls import drop_gradient_of
from helpers.stock_models import STOCK_MODELS


class StepLosses(Callback):
    """The loss of every training step, as the step returned it (on the last stage; other stages get ``None``)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is not None:
            self.losses.append(float(loss))


def main(spec_path):
    spec = json.loads(Path(spec_path).read_text())
    for run in spec["runs"]:
        out = Path(spec["out"]) / run["name"]
        out.mkdir(parents=True, exist_ok=True)
        losses = StepLosses()
        trainer = Trainer(
            strategy=lightning_pipe.GPipeStrategy(**run.get("strategy", {})),
            accelerator="cpu", devices=spec["devices"], max_steps=spec["steps"], logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, limit_val_batches=0, callbacks=[losses],
        )
        seed_everything(0, verbose=False)
        model = STOCK_MODELS[run["model"]](**run.get("options", {}))
        restore = drop_gradient_of(run["drop_gradient_of"]) if run.get("drop_gradient_of") is not None else None
        trainer.fit(model)
        if restore:
            restore()
        rank = trainer.global_rank
        torch.save(model.state_dict(), out / f"rank{rank}.pt")
        if run.get("save"):  # every rank takes part; global rank 0 writes the whole model as one file
            trainer.save_checkpoint(out / "model.ckpt")
        if run.get("validate"):  # the trained model's validation loss, reported on every rank
            trainer.limit_val_batches = 1.0  # fit skipped validation; validate every batch
            (out / f"validated{rank}.json").write_text(json.dumps(trainer.validate(model, verbose=False)))
        if run.get("predict"):  # in eval mode, without gradients: the last stage's predictions come back on rank 0
            predictions = trainer.predict(model)
            if rank == 0:
                torch.save(torch.cat(predictions), out / "predictions.pt")
        (out / f"rank{rank}.json").write_text(json.dumps({"losses": losses.losses}))


if __name__ == "__main__":
    main(sys.argv[1])
