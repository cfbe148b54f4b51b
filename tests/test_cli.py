"""LightningCLI selects and configures the strategy from the command line, and trains as on one device (needs the
`cli` extra)."""

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything

from helpers.compare import relative_weight_error
from helpers.launch import WORKERS, run_python
from helpers.models import PipeClassifier, loaders

pytest.importorskip("jsonargparse")


def test_lightning_cli_configures_the_gpipe_strategy(tmp_path):
    result = run_python(
        WORKERS / "cli_worker.py", "fit",
        "--trainer.strategy=lightning_pipe.GPipeStrategy", "--trainer.strategy.num_micro_batches=8",
        "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.max_steps=3", "--trainer.logger=false",
        "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false", "--seed_everything=0",
        cwd=tmp_path, check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "RESULT rank=0 strategy=GPipeStrategy micro_batches=8 steps=3" in result.stdout
    # The same training on one device: the CLI seeds, then builds the model and the data (64 and 32 samples).
    seed_everything(0)
    model = PipeClassifier()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False).fit(model, *loaders(64, 32, 16))
    for rank in range(2):
        trained = torch.load(tmp_path / f"rank{rank}.pt")
        assert relative_weight_error(initial, model.state_dict(), trained) < 1e-5
