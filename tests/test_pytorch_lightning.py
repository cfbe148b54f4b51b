"""A project that imports the standalone ``pytorch_lightning`` package (``import pytorch_lightning as pl``) moves onto
the pipeline as one that imports ``lightning.pytorch`` does: ``pl.Trainer(strategy="gpipe")`` and
``pl.Trainer(strategy=GPipeStrategy(...))`` train as on one device, both packages being installed (as ``lightning``
2.6 installs them), whichever is imported first."""

from __future__ import annotations

import json

import pytest
import torch

pl = pytest.importorskip("pytorch_lightning")

import lightning.pytorch as L  # noqa: E402

import lightning_pipe  # noqa: E402
from helpers.compare import relative_weight_error  # noqa: E402
from helpers.launch import launch, run_python  # noqa: E402
from helpers.stock_models import lit_autoencoder_class  # noqa: E402
from lightning_pipe.standalone import GPipeStrategy as StandaloneGPipeStrategy  # noqa: E402

STEPS = 4
TOLERANCE = 1e-5  # of the weights' change over the run, as tests/test_equivalence.py
# name -> (strategy, the model's arguments). By name, the strategy splits a batch into 8 micro-batches (4 per stage):
# batches of 32 give each micro-batch 4 samples.
# Trained with SGD: Adam amplifies round-off to its learning rate (the NOTE in helpers/stock_models.py).
RUNS = {"by_name": ("gpipe", {"batch_size": 32, "sgd_lr": 0.5}), "as_object": ({"num_micro_batches": 2}, {"sgd_lr": 0.5})}


def train_on_one_device(**options) -> tuple[list[float], dict, dict]:
    """The same project on one device, with pytorch_lightning's Trainer: losses, weights before and after."""
    pl.seed_everything(0, verbose=False)
    model = lit_autoencoder_class(pl.LightningModule)(**options)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    losses = []

    class StepLosses(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(outputs["loss"]))

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[StepLosses()])
    trainer.fit(model)
    return losses, before, model.state_dict()


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pytorch_lightning")
    runs = [{"name": name, "strategy": strategy, "options": options} for name, (strategy, options) in RUNS.items()]
    launch("pytorch_lightning_worker.py", {"devices": 2, "out": str(tmp), "steps": STEPS, "runs": runs}, tmp,
           timeout=600)
    return tmp


@pytest.mark.parametrize("name", sorted(RUNS))
def test_a_pytorch_lightning_project_pipelines_and_trains_as_on_one_device(pipelined, name):
    losses, before, after = train_on_one_device(**RUNS[name][1])
    result = json.loads((pipelined / name / "rank0.json").read_text())
    assert result["strategy"] == "lightning_pipe.standalone.GPipeStrategy"
    assert result["losses"] == pytest.approx(losses, rel=1e-5)
    weights = torch.load(pipelined / name / "rank0.pt")
    error = relative_weight_error(before, after, weights)
    assert error < TOLERANCE, f"{name}: weights differ by {error:.2e} of their change"


def test_the_comparison_detects_a_run_that_trained_differently(pipelined):
    _, before, after = train_on_one_device(sgd_lr=0.25)
    weights = torch.load(pipelined / "as_object" / "rank0.pt")
    assert relative_weight_error(before, after, weights) > 100 * TOLERANCE


def test_pytorch_lightning_imported_before_lightning_pipe_finds_the_strategy(tmp_path):
    script = (
        "import pytorch_lightning as pl\n"
        "import lightning_pipe\n"
        "trainer = pl.Trainer(strategy='gpipe', accelerator='cpu', devices=2, logger=False)\n"
        "print(type(trainer.strategy).__module__, trainer.strategy.num_processes)\n"
    )
    result = run_python("-c", script, cwd=tmp_path, timeout=120)
    assert result.stdout.split()[-2:] == ["lightning_pipe.standalone", "2"]


@pytest.mark.parametrize("trainer_package", [L, pl], ids=["lightning.pytorch", "pytorch_lightning"])
@pytest.mark.parametrize("strategy_class", [lightning_pipe.GPipeStrategy, StandaloneGPipeStrategy],
                         ids=["lightning_pipe.GPipeStrategy", "lightning_pipe.standalone.GPipeStrategy"])
def test_a_strategy_object_becomes_one_of_the_trainers_package(trainer_package, strategy_class):
    strategy = strategy_class(num_micro_batches=2)
    trainer = trainer_package.Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)
    assert trainer.strategy is strategy
    assert isinstance(strategy, trainer_package.strategies.ParallelStrategy)
    assert strategy.lightning_package.name == trainer_package.__name__
    assert isinstance(strategy, lightning_pipe.GPipeStrategy)  # the name a project checks for, under either


def test_a_subclass_of_one_packages_strategy_is_refused_by_the_other_packages_trainer():
    class Custom(lightning_pipe.GPipeStrategy):
        pass

    with pytest.raises(TypeError, match="Custom derives from lightning_pipe.strategy.GPipeStrategy, a strategy of"
                       " lightning.pytorch, but the Trainer comes from pytorch_lightning: derive it from"
                       " lightning_pipe.standalone.GPipeStrategy instead"):
        pl.Trainer(strategy=Custom(), accelerator="cpu", devices=2, logger=False)
