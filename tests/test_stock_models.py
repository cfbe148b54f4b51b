"""The stock models of tests/helpers/stock_models.py train on one device: the baseline their pipelines match."""

from __future__ import annotations

import math

import pytest
import torch
from lightning.pytorch import Callback, Trainer, seed_everything

from helpers.stock_models import STOCK_MODELS

pytest.importorskip("transformers")

STEPS = 4


class StepLosses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))


def train_on_one_device(
    name: str, accumulate: int = 1, **options
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Per-step losses, the weights before and the weights after ``STEPS`` steps of the model ``name``. With
    ``accumulate``, each step accumulates that many batches of ``1/accumulate`` of the size (what a per-micro-batch
    schedule equals for any loss); a step's loss is then the mean of its batches' (Lightning hands each batch's
    loss on divided by ``accumulate``: their sum)."""
    seed_everything(0, verbose=False)
    model = STOCK_MODELS[name](**options)
    if accumulate > 1:
        model.batch_size //= accumulate
    before = {key: value.clone() for key, value in model.state_dict().items()}
    losses = StepLosses()
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=STEPS, callbacks=[losses], logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      num_sanity_val_steps=0, limit_val_batches=0, accumulate_grad_batches=accumulate)
    trainer.fit(model)
    steps = [losses.losses[i:i + accumulate] for i in range(0, len(losses.losses), accumulate)]
    return [sum(step) for step in steps], before, model.state_dict()


@pytest.mark.parametrize("name", sorted(STOCK_MODELS))
def test_stock_model_learns_on_one_device(name):
    """Trained on one batch again and again (one batch per epoch), every model's loss falls and every weight moves."""
    losses, before, after = train_on_one_device(name, samples=8, batch_size=8)
    assert len(losses) == STEPS
    assert all(math.isfinite(loss) for loss in losses), losses
    assert losses[-1] < losses[0], f"{name}: the loss did not decrease over {STEPS} steps: {losses}"
    changed = [key for key in before if before[key].is_floating_point() and not torch.equal(before[key], after[key])]
    unchanged = {key for key, _ in STOCK_MODELS[name]().named_parameters()} - set(changed)
    assert not unchanged, f"{name}: parameters that training left unchanged: {unchanged}"


def test_stock_models_are_the_same_model_in_every_process():
    """A pipeline's ranks each build the model: the same seed must give the same weights and the same data."""
    for name, cls in STOCK_MODELS.items():
        seed_everything(0, verbose=False)
        first = cls()
        seed_everything(0, verbose=False)
        second = cls()
        for (key, a), b in zip(first.state_dict().items(), second.state_dict().values()):
            assert torch.equal(a, b), f"{name}.{key}"
        batch_a, batch_b = next(iter(first.train_dataloader())), next(iter(second.train_dataloader()))
        flat_a = list(batch_a.values()) if isinstance(batch_a, dict) else list(batch_a)
        flat_b = list(batch_b.values()) if isinstance(batch_b, dict) else list(batch_b)
        assert all(torch.equal(a, b) for a, b in zip(flat_a, flat_b)), name
