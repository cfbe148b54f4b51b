"""Lightning features behave under the gpipe strategy as on one device: loops, metrics, callbacks, checkpoints."""

from __future__ import annotations

import pytest
import torch

from helpers.launch import launch
from helpers.scenarios import fit_test_predict

SCHEDULERS = {"plain": None, "step": "step", "epoch": "epoch", "plateau": "plateau"}


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("parity")
    runs = [{"name": name, "scheduler": scheduler} for name, scheduler in SCHEDULERS.items()]
    launch("lightning_parity_worker.py", {"devices": 2, "out": str(tmp), "runs": runs}, tmp)
    return {name: [torch.load(tmp / name / f"rank{r}.pt", weights_only=False) for r in range(2)] for name in SCHEDULERS}


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    return {name: fit_test_predict(tmp / name, scheduler, devices=1) for name, scheduler in SCHEDULERS.items()}


def relative_error(initial_free_expected: dict, actual: dict) -> float:
    error = torch.sqrt(sum(((actual[k] - v) ** 2).sum() for k, v in initial_free_expected.items()))
    return float(error / torch.sqrt(sum((v**2).sum() for v in initial_free_expected.values())))


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_model_after_fit_is_whole_and_equal_on_every_rank(pipelined, single_device, name):
    expected = single_device[name]["state_dict"]
    for result in pipelined[name]:
        assert result["state_dict"].keys() == expected.keys()
        assert relative_error(expected, result["state_dict"]) < 1e-5


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_metrics_and_callbacks_match_single_device(pipelined, single_device, name):
    expected = single_device[name]
    for result in pipelined[name]:  # ModelCheckpoint and EarlyStopping run on every rank: all must agree
        assert result["stopped_epoch"] == expected["stopped_epoch"]
        assert result["best_k"] == expected["best_k"]
        assert result["best_score"] == pytest.approx(expected["best_score"], rel=1e-5)
        assert len(result["validation_metrics"]) == len(expected["validation_metrics"])
        for got, want in zip(result["validation_metrics"], expected["validation_metrics"]):
            ours = {key for key in got if key.startswith("pipeline/")}  # the strategy's own bubble metrics
            assert got.keys() - ours == want.keys()
            for key in want:
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key


def test_step_outputs_reach_rank_zero_callbacks(pipelined, single_device):
    rank_zero = pipelined["plain"][0]
    assert rank_zero["global_rank"] == 0
    assert rank_zero["step_losses"] == pytest.approx(single_device["plain"]["step_losses"], rel=1e-5)


def test_test_loop_logs_the_same_metrics_for_the_model_and_the_best_checkpoint(pipelined, single_device):
    expected = single_device["plain"]
    for result in pipelined["plain"]:
        for key in ("tested", "tested_best"):
            assert result[key][0].keys() == expected[key][0].keys()
            for metric, value in expected[key][0].items():
                assert result[key][0][metric] == pytest.approx(value, rel=1e-5), (key, metric)


def test_predict_returns_the_same_predictions_in_the_launching_process(pipelined, single_device):
    rank_zero = pipelined["plain"][0]
    torch.testing.assert_close(rank_zero["predictions"], single_device["plain"]["predictions"], rtol=1e-5, atol=1e-6)
