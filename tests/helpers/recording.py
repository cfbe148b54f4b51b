"""Callbacks that record what Lightning shows a user: per-step training loss and the final metrics."""

from lightning.pytorch import Callback


class MetricRecorder(Callback):
    def __init__(self) -> None:
        self.train_losses: list[float] = []
        self.final_metrics: dict[str, float] = {}
        self.grad_scale: float | None = None
        self.batches: list[list[int]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.train_losses.append(float(trainer.callback_metrics["train_loss"]))
        labels = batch["labels"] if isinstance(batch, dict) else batch[1]
        self.batches.append(labels.tolist())  # which samples this rank trained on

    def on_fit_end(self, trainer, pl_module):
        self.final_metrics = {key: float(value) for key, value in trainer.callback_metrics.items()}
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.grad_scale = float(scaler.get_scale()) if scaler is not None else None

    def summary(self) -> dict:
        return {"train_losses": self.train_losses, "final_metrics": self.final_metrics, "grad_scale": self.grad_scale,
                "batches": self.batches}


class StepLossRecording:
    """The loss of every training step, as the step returned it (on the last stage; other stages get ``None``): a
    callback once mixed with the ``Callback`` of either Lightning package."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        if loss is not None:
            self.losses.append(float(loss))
