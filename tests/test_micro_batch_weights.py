"""Hugging Face models under the per-micro-batch schedules: each micro-batch's loss weighted by the labels the
model's loss counts, as transformers' Trainer counts ``num_items_in_batch``, with nothing written by the user.

A causal LM's token mean on right-padded batches of varying lengths equals one device on the whole batch under every
per-micro-batch schedule; weighting by samples (the negative control) does not. T5 under ``1f1b`` equals one device
with SGD and with AdamW, and under the split-backward schedules (``zbv``, ``zero_bubble``) with SGD: there its
position bias, computed from the first block's weights alone, carried on and used by the later blocks, gets its
gradient from both (tests/test_split_backward.py holds the small case and its negative control).
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from helpers.compare import relative_weight_error
from helpers.launch import launch
from helpers.stock_models import STOCK_MODELS, CountingSequences, gpt2_config
from lightning_pipe.execution.loss_items import LossItems, unequal_label_shares
from lightning_pipe.partition import microbatch
from test_stock_models import STEPS, train_on_one_device

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-5  # of the weights' change over the run
PER_MICRO_BATCH = ("1f1b", "interleaved_1f1b", "zero_bubble", "zbv")
T5_SGD = {"sgd_lr": 0.5}
# name -> (model, strategy settings, the model's options)
RUNS = {
    **{f"llama_{schedule}": ("llama", {"num_micro_batches": 4, "schedule": schedule}, {})
       for schedule in PER_MICRO_BATCH},
    "llama_1f1b_by_samples": ("llama", {"num_micro_batches": 4, "schedule": "1f1b"}, {"weight_by_samples": True}),
    "t5_1f1b": ("t5", {"num_micro_batches": 4, "schedule": "1f1b"}, T5_SGD),
    "t5_zbv": ("t5", {"num_micro_batches": 4, "schedule": "zbv"}, T5_SGD),
    "t5_zero_bubble": ("t5", {"num_micro_batches": 4, "schedule": "zero_bubble"}, T5_SGD),
    "t5_1f1b_adam": ("t5", {"num_micro_batches": 4, "schedule": "1f1b"}, {}),
}


class Module(nn.Module):
    """A LightningModule's stand-in holding a model at ``self.model``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def padded_batch(samples: int = 8) -> dict[str, torch.Tensor]:
    data = CountingSequences(samples, seed=3)
    return {"input_ids": data.input_ids, "attention_mask": data.attention_mask, "labels": data.labels}


# ---- without processes: what is counted -------------------------------------------------------------------------


def test_a_causal_lm_counts_its_labels_after_the_shift_as_transformers_trainer_does():
    batch = padded_batch()
    items = LossItems.of(Module(transformers.GPT2LMHeadModel(gpt2_config())), batch)
    assert items.count(batch) == int((batch["labels"][:, 1:] != -100).sum()) < int((batch["labels"] != -100).sum())
    shifted = {**batch, "shift_labels": batch["labels"][:, 1:]}
    assert LossItems.of(Module(transformers.GPT2LMHeadModel(gpt2_config())), shifted).says.startswith("the batch's")


def test_an_encoder_decoder_and_a_classifier_count_every_label():
    batch = padded_batch()
    t5 = LossItems.of(STOCK_MODELS["t5"](), batch)
    assert t5.count(batch) == int((batch["labels"] != -100).sum())
    bert = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=32))
    classes = {"input_ids": batch["input_ids"], "labels": torch.arange(8) % 2}
    assert LossItems.of(Module(bert), classes).per_micro_batch([classes], [8]) == [8.0]  # its samples


def test_the_modules_own_items_in_loss_comes_first_and_samples_without_labels():
    module = STOCK_MODELS["llama"](weight_by_samples=True)
    assert LossItems.of(module, padded_batch()).per_micro_batch([padded_batch(2), padded_batch(6)], [2, 6]) == [2, 6]
    assert LossItems.of(Module(transformers.GPT2LMHeadModel(gpt2_config())), (torch.ones(2),)).count is None


def test_weights_by_the_count_make_the_micro_batches_token_means_the_whole_batchs():
    """In one process: GPT-2's own loss on 4 micro-batches of a padded batch, weighted by the counted labels, is its
    loss on the whole batch; weighted by samples it is not."""
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(gpt2_config()).eval()
    batch = padded_batch()
    parts = microbatch.split_batch(batch, 4)
    items = LossItems.of(Module(model), batch).per_micro_batch(parts, [2] * 4)
    losses = torch.stack([model(**part).loss for part in parts])
    whole = model(**batch).loss
    assert float((losses * torch.tensor(items)).sum() / sum(items)) == pytest.approx(float(whole), rel=1e-6)
    assert abs(float(losses.mean()) - float(whole)) > 1e-4 * float(whole)  # by samples: 1.4e-4 off at random init


def test_a_model_the_strategy_cannot_count_for_is_warned_of_where_its_labels_are_uneven():
    """A base model with the LightningModule's own loss: weighted by samples; the labels say that a token mean would
    be wrong, and the warning names the counts; even labels give no warning."""
    model = transformers.LlamaModel(transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32,
                                                             num_hidden_layers=1, num_attention_heads=4))
    batch = padded_batch()
    assert LossItems.of(Module(model), batch).count is None
    parts = microbatch.split_batch(batch, 4)
    assert unequal_label_shares(parts, [2] * 4).startswith("labels not -100 per micro-batch [")
    even = {**batch, "labels": batch["input_ids"]}
    assert unequal_label_shares(microbatch.split_batch(even, 4), [2] * 4) is None


# ---- pipelined: every schedule, and T5 ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("weights")
    runs = [{"name": name, "model": model, "strategy": settings, "options": options}
            for name, (model, settings, options) in RUNS.items()]
    launch("stock_pipelines_worker.py", {"devices": 2, "out": str(tmp), "steps": STEPS, "runs": runs}, tmp,
           timeout=900)
    return tmp


_one_device: dict[str, tuple] = {}


def one_device(model: str, **options) -> tuple[list[float], dict, dict]:
    key = json.dumps([model, options], sort_keys=True)
    if key not in _one_device:
        _one_device[key] = train_on_one_device(model, **options)
    return _one_device[key]


def errors(tmp, name: str) -> tuple[float, float, dict, dict]:
    """(largest relative difference of a step's loss, weights' difference relative to their change, one device's
    weights before and after) against one device on the whole batch."""
    model, _, options = RUNS[name]
    options = {key: value for key, value in options.items() if key != "weight_by_samples"}
    losses, before, after = one_device(model, **options)
    result = json.loads((tmp / name / "rank0.json").read_text())
    loss_error = max(abs(a - b) / abs(b) for a, b in zip(result["losses"], losses))
    pipelined = torch.load(tmp / name / "rank0.pt")
    floating = [key for key, value in after.items() if value.is_floating_point()]
    weight_error = relative_weight_error(
        {k: before[k] for k in floating}, {k: after[k] for k in floating}, {k: pipelined[k] for k in floating}
    )
    return loss_error, weight_error, after, pipelined


@pytest.mark.parametrize("schedule", PER_MICRO_BATCH)
def test_a_causal_lm_on_padded_batches_equals_one_device_on_the_whole_batch(pipelined, schedule):
    loss_error, weight_error, _, _ = errors(pipelined, f"llama_{schedule}")
    assert loss_error < 1e-5 and weight_error < TOLERANCE, (loss_error, weight_error)


def test_weighting_by_samples_on_the_same_data_differs(pipelined):
    """Negative control: the same run with the LightningModule's items_in_loss counting samples."""
    _, weight_error, _, _ = errors(pipelined, "llama_1f1b_by_samples")
    assert weight_error > 100 * TOLERANCE


def test_t5_under_1f1b_equals_one_device_with_sgd_and_with_adamw(pipelined):
    """Weighted by its labels, T5 under 1f1b equals one device on the whole batch with SGD and with AdamW alike."""
    for name in ("t5_1f1b", "t5_1f1b_adam"):
        loss_error, weight_error, _, _ = errors(pipelined, name)
        assert loss_error < 1e-5 and weight_error < TOLERANCE, (name, loss_error, weight_error)


def test_t5_under_the_split_backward_schedules_equals_one_device_with_sgd(pipelined):
    """Each stack's position bias (from its first block's weights alone, carried to the later blocks) gets its
    gradient from this stage's blocks as well as the next stage's in the deferred weight half (it was 2% off)."""
    for name in ("t5_zbv", "t5_zero_bubble"):
        loss_error, weight_error, _, _ = errors(pipelined, name)
        assert loss_error < 1e-5 and weight_error < TOLERANCE, (name, loss_error, weight_error)
