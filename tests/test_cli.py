"""LightningCLI selects and configures the strategy from the command line (needs the `cli` extra)."""

import os
import subprocess
import sys

import pytest

from helpers.compare import REPO, WORKERS

pytest.importorskip("jsonargparse")


def test_lightning_cli_configures_the_gpipe_strategy(tmp_path):
    command = [
        sys.executable, str(WORKERS / "cli_main.py"), "fit",
        "--trainer.strategy=lightning_pipe.GPipeStrategy", "--trainer.strategy.num_micro_batches=8",
        "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.max_steps=3", "--trainer.logger=false",
        "--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false",
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "RESULT rank=0 strategy=GPipeStrategy micro_batches=8 steps=3" in result.stdout
