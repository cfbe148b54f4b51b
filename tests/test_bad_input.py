"""Misuse fails in the launching process, before any worker starts, with an error that names the fix."""

from __future__ import annotations

import pytest
from lightning.pytorch import Trainer
from torch import nn

from helpers.launch import run_python
from helpers.models import PipeClassifier, loaders
from lightning_pipe import GPipeStrategy


def fit(model, strategy, devices=2):
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_steps=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, *loaders(32, 16, 16))


class NoSequential(PipeClassifier):
    """One module holds every layer, and the step chains nothing: there is nothing to split (with a head after
    ``net``, the step's chain ``net, head`` would be pipelined)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Linear(12, 3)
        del self.head

    def forward(self, x):
        return self.net(x.view(len(x), -1))


@pytest.mark.parametrize(
    ("model", "strategy", "error", "message"),
    [
        (NoSequential(), GPipeStrategy(), ValueError, "contains no nn.Sequential or nn.ModuleList to pipeline"),
        (PipeClassifier(), GPipeStrategy(balance=[3, 4]), ValueError, "sums to 7 but the pipelined module has 8"),
        (PipeClassifier(), GPipeStrategy(module_name="net"), TypeError, "names a Component, not an nn.Sequential or nn.ModuleList"),
    ],
    ids=["no-sequential", "balance-sum", "not-a-sequential"],
)
def test_partition_errors_raise_before_launch(model, strategy, error, message):
    with pytest.raises(error, match=message):
        fit(model, strategy)


def test_more_stages_than_blocks_names_the_region_and_the_limit():
    model = PipeClassifier(depth=2)  # 2 blocks: Linear, Tanh
    with pytest.raises(ValueError, match=r"^num_stages=3 needs at least 3 blocks to pipeline, but the pipelined blocks"
                                         r" are 'net.model' \(an nn.Sequential of 2 blocks\), the container holding"
                                         r" the most parameters .*; use at most 2 stages\.$"):
        fit(model, GPipeStrategy(), devices=3)


@pytest.mark.parametrize("value", [0, -1])
def test_num_micro_batches_below_one_is_rejected(value):
    with pytest.raises(ValueError, match=f"num_micro_batches={value} is invalid"):
        GPipeStrategy(num_micro_batches=value)


def test_unknown_checkpoint_mode_is_rejected():
    with pytest.raises(ValueError, match="checkpoint='sometimes' is not a checkpoint mode"):
        GPipeStrategy(checkpoint="sometimes")


class ManualOptimization(PipeClassifier):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False


def test_manual_optimization_is_refused_before_launch():
    with pytest.raises(RuntimeError, match="supports automatic optimization only"):
        fit(ManualOptimization(), GPipeStrategy())
