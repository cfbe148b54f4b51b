"""LightningCLI selects and configures the strategy from the command line (needs the `cli` extra)."""

import pytest

from helpers.launch import WORKERS, run_python

pytest.importorskip("jsonargparse")


def test_lightning_cli_configures_the_gpipe_strategy(tmp_path):
    result = run_python(
        WORKERS / "cli_worker.py", "fit",
        "--trainer.strategy=lightning_pipe.GPipeStrategy", "--trainer.strategy.num_micro_batches=8",
        "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.max_steps=3", "--trainer.logger=false",
        "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
        cwd=tmp_path, check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "RESULT rank=0 strategy=GPipeStrategy micro_batches=8 steps=3" in result.stdout
