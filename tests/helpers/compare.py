"""Compare the results of pipelined runs (see :func:`helpers.launch.launch`) with single-device training."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from lightning.pytorch import Trainer, seed_everything
from torch.utils.data import DataLoader
from lightning.pytorch.plugins import MixedPrecision

import lightning_pipe

from helpers.models import MODELS, loaders, sequence_loaders
from helpers.stock_models import padded_token_loaders
from helpers.recording import MetricRecorder


def merged_state_dict(run_dir: Path) -> dict[str, torch.Tensor]:
    """The whole model from the per-rank state dicts (each rank holds its stage plus the replicated parameters).

    A tensor held by several ranks (a replicated parameter) must be identical on all of them. A tensor on the meta
    device (another stage's layer of a model built on the meta device) is not held.
    """
    merged: dict[str, torch.Tensor] = {}
    for path in sorted(run_dir.glob("rank*.pt")):
        for key, value in torch.load(path).items():
            if value.is_meta:
                continue
            if key in merged:
                assert torch.equal(merged[key], value), f"replicated tensor {key} differs between ranks"
            merged[key] = value
    return merged


def rank_results(run_dir: Path) -> list[dict]:
    return [json.loads(path.read_text()) for path in sorted(run_dir.glob("rank*.json"))]


def single_device_run(run: dict) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    """Initial weights, final weights and recorded metrics of the same training on one device."""
    seed_everything(0)
    model = MODELS[run.get("model", "classifier")](lr=run.get("lr", 0.5))
    model.configure_model()  # (a no-op unless the model builds its layers there)
    if run.get("empty_init"):  # the weights the gpipe strategy gives a model created on the meta device
        lightning_pipe.init_weights(model)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    if run.get("data") == "sequences":
        train, val = sequence_loaders(run.get("train_samples", 80), run.get("val_samples", 40), 16)
    elif run.get("data") == "padded_tokens":
        train, val = padded_token_loaders(run.get("train_samples", 80), run.get("val_samples", 40), 16)
    else:
        train, val = loaders(run.get("train_samples", 80), run.get("val_samples", 40), run.get("batch_size", 16))
    if run.get("shuffled_like_distributed_sampler"):
        # The samples of one step of all replicas of a shuffling DistributedSampler (seed 0, epoch 0), in one batch.
        order = torch.randperm(len(train.dataset), generator=torch.Generator().manual_seed(0)).tolist()
        train = DataLoader(train.dataset, batch_size=train.batch_size, sampler=order)
    recorder = MetricRecorder()
    trainer = Trainer(
        accelerator="cpu", devices=1, max_epochs=run.get("max_epochs", 1), logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder],
        **run.get("trainer", {}),
        plugins=[MixedPrecision("16-mixed", "cpu")] if run.get("fp16") else None,
    )
    trainer.fit(model, train, val)
    summary = recorder.summary()
    if hasattr(model, "forward_counts"):
        summary["forward_counts"] = model.forward_counts()
    return initial, model.state_dict(), summary


def relative_weight_error(initial: dict, expected: dict, actual: dict) -> float:
    """|actual - expected| / |expected - initial| over all weights: the error relative to what training changed."""
    assert actual.keys() == expected.keys(), f"keys differ: {set(actual) ^ set(expected)}"
    error = torch.sqrt(sum(((actual[k] - expected[k]) ** 2).sum() for k in expected))
    change = torch.sqrt(sum(((expected[k] - initial[k]) ** 2).sum() for k in expected))
    assert change > 1e-2, "the reference training barely changed the weights: raise the learning rate"
    return float(error / change)
