"""Lightning features behave under the gpipe strategy as on one device: loops, metrics, callbacks, checkpoints; under
GPipe and under the per-micro-batch schedules with two chunks per stage."""

from __future__ import annotations

import pytest
import torch

from helpers.launch import launch
from helpers.scenarios import fit_test_predict

SCHEDULERS = {"plain": None, "step": "step", "epoch": "epoch", "plateau": "plateau", "plateau_cut": "plateau"}
# Early stopping ends "plateau" in the epoch whose validation would cut the learning rate; "plateau_cut" trains on.
TRAINS_ON = {"plateau_cut"}
# Pipelined runs under another schedule: (the one-device run they equal, the schedule). ProjectModule's losses and
# accuracy are means over samples, so a step per micro-batch gives the whole batch's values.
SCHEDULED = {"plain_interleaved": ("plain", "interleaved_1f1b"), "step_zbv": ("step", "zbv")}
REFERENCE = {name: name for name in SCHEDULERS} | {name: reference for name, (reference, _) in SCHEDULED.items()}
# MulticlassAccuracy averages over classes, not samples: a per-micro-batch step logs the weighted mean of its
# micro-batches' values as the step value (docs/schedules.md#per-micro-batch-step); the epoch value is the batch's.
STEP_VALUES_OF_A_CLASS_AVERAGE = {"train/acc", "train/acc_step"}


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parity")
    runs = [{"name": name, "scheduler": scheduler, "early_stopping": name not in TRAINS_ON}
            for name, scheduler in SCHEDULERS.items()]
    runs += [{"name": name, "scheduler": SCHEDULERS[reference], "early_stopping": reference not in TRAINS_ON,
              "strategy": {"schedule": schedule}} for name, (reference, schedule) in SCHEDULED.items()]
    launch("lightning_parity_worker.py", {"devices": 2, "out": str(tmp), "runs": runs}, tmp)
    return {name: [torch.load(tmp / name / f"rank{r}.pt", weights_only=False) for r in range(2)] for name in REFERENCE}


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    return {name: fit_test_predict(tmp / name, scheduler, name not in TRAINS_ON, devices=1)
            for name, scheduler in SCHEDULERS.items()}


def relative_error(initial_free_expected: dict, actual: dict) -> float:
    error = torch.sqrt(sum(((actual[k] - v) ** 2).sum() for k, v in initial_free_expected.items()))
    return float(error / torch.sqrt(sum((v**2).sum() for v in initial_free_expected.values())))


@pytest.mark.parametrize("name", list(REFERENCE))
def test_model_after_fit_is_whole_and_equal_on_every_rank(pipelined, single_device, name):
    expected = single_device[REFERENCE[name]]["state_dict"]
    for result in pipelined[name]:
        assert result["state_dict"].keys() == expected.keys()
        assert relative_error(expected, result["state_dict"]) < 1e-5


@pytest.mark.parametrize("name", list(REFERENCE))
def test_metrics_and_callbacks_match_single_device(pipelined, single_device, name):
    expected = single_device[REFERENCE[name]]
    for result in pipelined[name]:  # ModelCheckpoint and EarlyStopping run on every rank: all must agree
        assert result["stopped_epoch"] == expected["stopped_epoch"]
        assert result["best_k"] == expected["best_k"]
        assert result["best_score"] == pytest.approx(expected["best_score"], rel=1e-5)
        assert len(result["validation_metrics"]) == len(expected["validation_metrics"])
        for got, want in zip(result["validation_metrics"], expected["validation_metrics"]):
            ours = {key for key in got if key.startswith("pipeline/")}  # the strategy's own bubble metrics
            assert got.keys() - ours == want.keys()
            for key in want.keys() - (STEP_VALUES_OF_A_CLASS_AVERAGE if name in SCHEDULED else set()):
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key


@pytest.mark.parametrize("name", ["plain", "plain_interleaved"])
def test_step_outputs_reach_rank_zero_callbacks(pipelined, single_device, name):
    rank_zero = pipelined[name][0]
    assert rank_zero["global_rank"] == 0
    assert rank_zero["step_losses"] == pytest.approx(single_device["plain"]["step_losses"], rel=1e-5)


@pytest.mark.parametrize("name", ["plain", "plain_interleaved", "step_zbv"])
def test_test_loop_logs_the_same_metrics_for_the_model_and_the_best_checkpoint(pipelined, single_device, name):
    expected = single_device[REFERENCE[name]]
    for result in pipelined[name]:
        for key in ("tested", "tested_best"):
            assert result[key][0].keys() == expected[key][0].keys()
            for metric, value in expected[key][0].items():
                assert result[key][0][metric] == pytest.approx(value, rel=1e-5), (key, metric)


@pytest.mark.parametrize("name", ["plain", "step_zbv"])
def test_predict_returns_the_same_predictions_in_the_launching_process(pipelined, single_device, name):
    rank_zero = pipelined[name][0]
    expected = single_device[REFERENCE[name]]["predictions"]
    torch.testing.assert_close(rank_zero["predictions"], expected, rtol=1e-5, atol=1e-6)


def test_plateau_learning_rate_cut_reaches_the_weights_as_on_one_device(pipelined, single_device):
    """ReduceLROnPlateau halves the rate after a worse validation loss; the epochs after it train at the cut rate on
    every stage, and the weights at the end equal one device's (see `test_model_after_fit_is_whole_and_equal_...`)."""
    expected = single_device["plateau_cut"]["epoch_learning_rates"]
    assert expected[0] > expected[-1] and len(expected) == 5, expected  # the cut came before the last epochs
    for result in pipelined["plateau_cut"]:
        assert result["epoch_learning_rates"] == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("name", ["plain", "plateau_cut"])
def test_validate_after_fit_logs_the_same_metrics_as_one_device(pipelined, single_device, name):
    expected = single_device[name]["validated"]
    for result in pipelined[name]:
        assert result["validated"][0].keys() == expected[0].keys()
        for metric, value in expected[0].items():
            assert result["validated"][0][metric] == pytest.approx(value, rel=1e-5), metric


EVALUATED_UNDER_INFERENCE_MODE = r"""
import sys
import torch, torch.nn as nn, torch.nn.functional as F
import lightning.pytorch as pl
import lightning.pytorch.loops.utilities as loop_utilities
from torch.utils.data import DataLoader, TensorDataset
import lightning_pipe

# With gloo Lightning evaluates under torch.no_grad; with NCCL, `validate`, `test` and `predict` run under
# torch.inference_mode (a fit's own validation under no_grad). Seen as not distributed, the loops take the NCCL
# branch here: the tensors `validate` makes (placeholders, messages) are inference tensors.
loop_utilities._distributed_is_initialized = lambda: False

class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(4)])
        self.modes = set()
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.model(x), y)
    def validation_step(self, batch, batch_idx):
        self.modes.add(torch.is_inference_mode_enabled())
        x, y = batch
        self.log("val", F.mse_loss(self.model(x), y))
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

data = TensorDataset(torch.randn(64, 16), torch.randn(64, 16))
for schedule in ("gpipe", "1f1b"):
    module = Module()
    trainer = pl.Trainer(
        strategy=lightning_pipe.GPipeStrategy(num_stages=2, num_micro_batches=4, schedule=schedule), devices=2,
        accelerator="cpu", max_epochs=2, val_check_interval=2, limit_train_batches=4, limit_val_batches=2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.validate(module, DataLoader(data, batch_size=16))  # under inference_mode, the same shapes as training
    assert module.modes == {True}, module.modes
    trainer.fit(module, DataLoader(data, batch_size=16), DataLoader(data, batch_size=16))  # fit validates: no_grad
    trainer.validate(module, DataLoader(data, batch_size=16))
    assert module.modes == {True, False} and trainer.global_step == 8, (module.modes, trainer.global_step)
    print(f"rank {trainer.global_rank}: {schedule} trained on after validating under inference_mode", flush=True)
"""


def test_training_goes_on_after_validation_under_inference_mode(tmp_path):
    """``trainer.validate`` under ``torch.inference_mode`` (as Lightning runs it with NCCL), then a fit, then
    ``validate`` again: nothing made under inference mode (a cached placeholder, a receive buffer) reaches a later
    step as an inference tensor."""
    from helpers.launch import run_python

    script = tmp_path / "evaluated_under_inference_mode.py"  # a file: Lightning's launcher runs it again per rank
    script.write_text(EVALUATED_UNDER_INFERENCE_MODE)
    result = run_python(script, cwd=tmp_path, timeout=180, check=False)
    output = (tmp_path / "stdout.txt").read_text() + (tmp_path / "stderr.txt").read_text()
    assert result.returncode == 0, output
    for schedule in ("gpipe", "1f1b"):
        assert f"rank 0: {schedule} trained on after validating under inference_mode" in output, output
