"""Calling the model outside a step (callbacks, ModelSummary) runs through the pipeline, or fails fast."""

import time

import torch
from lightning.pytorch import seed_everything

from helpers.launch import launch
from helpers.models import PipeClassifier


def test_model_called_on_every_rank_returns_the_whole_models_output_everywhere(tmp_path):
    launch("outside_step_worker.py", {"out": str(tmp_path), "where": "everywhere"}, tmp_path)
    seed_everything(0)
    expected = PipeClassifier()(torch.linspace(-1, 1, 5 * 12).view(5, 3, 4))
    for rank in range(2):
        torch.testing.assert_close(torch.load(tmp_path / f"output_rank{rank}.pt"), expected)


def test_model_called_on_rank_zero_only_fails_fast_with_the_fix(tmp_path):
    start = time.monotonic()
    result = launch("outside_step_worker.py", {"out": str(tmp_path), "where": "rank_zero"}, tmp_path, 120, check=False)
    assert result.returncode != 0
    assert "not on every pipeline stage" in result.stderr
    assert "call the model on every rank" in result.stderr
    assert time.monotonic() - start < 60
