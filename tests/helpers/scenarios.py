"""Training scenarios run the same way under the gpipe strategy (in a worker) and on one device (in the test)."""

from __future__ import annotations

from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch.utils.data import DataLoader

from helpers.models import ProjectModule, classification_data


class ParityRecorder(Callback):
    """What a user's callbacks see: step outputs on rank 0, metrics after each validation, on every rank."""

    def __init__(self) -> None:
        self.step_losses: list[float] = []
        self.validation_metrics: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.is_global_zero:
            assert set(outputs) == {"loss", "preds", "targets"}, outputs.keys()
            self.step_losses.append(float(outputs["loss"]))

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.validation_metrics.append({k: float(v) for k, v in trainer.callback_metrics.items()})


def data(samples: int, seed: int) -> DataLoader:
    return DataLoader(classification_data(samples, seed=seed), batch_size=16)


def fit_test_predict(out: Path, scheduler: str | None, **trainer_kwargs) -> dict:
    """Fit with ModelCheckpoint and EarlyStopping, then test the model, test the best checkpoint, and predict."""
    seed_everything(0)
    model = ProjectModule(scheduler=scheduler)
    recorder = ParityRecorder()
    checkpoint = ModelCheckpoint(dirpath=out / "ckpt", monitor="val_loss", save_top_k=2, filename="{epoch}")
    stopping = EarlyStopping(monitor="val_loss", min_delta=0.02, patience=0)
    trainer = Trainer(accelerator="cpu", max_epochs=5, logger=False, enable_progress_bar=False,
                      callbacks=[recorder, checkpoint, stopping], **trainer_kwargs)
    trainer.fit(model, data(64, 0), data(32, 1))
    tested = trainer.test(model, data(32, 2), verbose=False)
    tested_best = trainer.test(ckpt_path="best", dataloaders=data(32, 2), verbose=False)
    predictions = trainer.predict(model, data(20, 3))
    return {
        "state_dict": {k: v.clone() for k, v in model.state_dict().items()},
        "step_losses": recorder.step_losses,
        "validation_metrics": recorder.validation_metrics,
        "stopped_epoch": stopping.stopped_epoch,
        "best_k": sorted(Path(p).name for p in checkpoint.best_k_models),
        "best_score": float(checkpoint.best_model_score),
        "tested": tested,
        "tested_best": tested_best,
        "predictions": torch.cat(predictions) if trainer.is_global_zero else None,  # computed on the last stage
        "global_rank": trainer.global_rank,
    }


def fit_epochs(out: Path, epochs: int, ckpt_path: str | None = None, save_after_fit: bool = False,
               **trainer_kwargs) -> dict:
    """Fit ProjectModule (SGD with momentum: the optimizer has state) for ``epochs``, saving the last checkpoint
    (and, with ``save_after_fit``, ``trainer.save_checkpoint(out / "after_fit.ckpt")`` once fit has returned)."""
    seed_everything(0 if ckpt_path is None else 1)  # a resumed run must take its weights from the checkpoint
    model = ProjectModule(scheduler="epoch")
    checkpoint = ModelCheckpoint(dirpath=out / "ckpt", save_last=True)
    trainer = Trainer(accelerator="cpu", max_epochs=epochs, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=[checkpoint], **trainer_kwargs)
    trainer.fit(model, data(64, 0), data(32, 1), ckpt_path=ckpt_path)
    if save_after_fit:
        trainer.save_checkpoint(out / "after_fit.ckpt")
    return {"state_dict": {k: v.clone() for k, v in model.state_dict().items()}, "global_rank": trainer.global_rank}
