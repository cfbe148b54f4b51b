"""What users' code names keeps working across the package's moves: the public names, the commands, the
Hydra schema, the module paths the docs once showed, and a checkpoint written before the package had folders."""

from __future__ import annotations

import importlib
import sys
import tomllib
import warnings
from pathlib import Path

import pytest
import torch

import lightning_pipe
from helpers.launch import launch, run_python
from helpers.scenarios import fit_epochs
from lightning_pipe.integration.former_paths import FORMER_PATHS

# lightning_pipe.__all__ at commit 6534a2b, the last before the folders.
PUBLIC_NAMES = ["GPipeStrategy", "PipelineParallelConfig", "PretrainedWeights", "init_weights"]
# A consolidated checkpoint that commit 6534a2b wrote: tests/workers/checkpoints_worker.py, 2 stages, 1 epoch.
OLD_CHECKPOINT = "checkpoint_6534a2b_two_stages.ckpt"
REPO_DATA = Path(__file__).resolve().parent / "data"


def test_every_public_name_is_still_exported():
    assert set(PUBLIC_NAMES) <= set(lightning_pipe.__all__)
    for name in PUBLIC_NAMES:
        assert getattr(lightning_pipe, name) is not None, name
    assert lightning_pipe.PipelineParallelConfig(num_stages=2, num_micro_batches=4).num_stages == 2


@pytest.mark.parametrize("former", sorted(FORMER_PATHS))
def test_a_former_module_path_imports_the_module_at_its_new_place_with_a_warning(former):
    sys.modules.pop(former, None)
    with pytest.warns(DeprecationWarning, match=FORMER_PATHS[former].replace(".", r"\.")):
        module = importlib.import_module(former)
    assert module is importlib.import_module(FORMER_PATHS[former])


def test_the_old_imports_of_the_docs_and_examples_still_run():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from lightning_pipe.engine import PipelineMismatchError
        from lightning_pipe.hydra import validate_config
        from lightning_pipe.pretrained import PretrainedMismatchError
        from lightning_pipe.schedule import clock_cycles, custom_schedule, gpipe, render_timeline
        from lightning_pipe.stall_rule import PipelineStallError
    assert issubclass(PipelineMismatchError, RuntimeError) and issubclass(PretrainedMismatchError, ValueError)
    assert issubclass(PipelineStallError, Exception) and callable(validate_config)
    assert clock_cycles(2, 4, custom_schedule(gpipe)).bubble_fraction == pytest.approx(0.2)
    assert render_timeline(2, 2).splitlines()[1].split()[:4] == ["stage", "0", "F0", "F1"]


def test_the_hydra_schema_keeps_its_names():
    """conf/strategy/gpipe.yaml's schema and resolver, under the names that projects' configs use."""
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    from lightning_pipe.integration import hydra_schema

    hydra_schema.register_configs()
    assert "gpipe_schema.yaml" in ConfigStore.instance().repo["strategy"]
    assert OmegaConf.has_resolver("lightning_pipe.start_method")


def test_the_commands_still_run_by_their_former_module_names(tmp_path):
    """``python -m lightning_pipe.plan`` and the others, as the docs showed them before the ``lightning-pipe`` script."""
    script = """
import runpy, sys
for command in ("lightning_pipe.trace", "lightning_pipe.plan", "lightning_pipe.consolidate_checkpoint",
                "lightning_pipe.export_pretrained"):
    sys.argv = [command, "--help"]
    try:
        runpy.run_module(command, run_name="__main__", alter_sys=True)
    except SystemExit as exit:
        assert exit.code in (0, None), (command, exit.code)
    print("ran", command)
"""
    result = run_python("-c", script, cwd=tmp_path, timeout=120)
    assert result.stdout.count("ran lightning_pipe.") == 4, result.stdout + result.stderr[-2000:]
    assert result.stdout.count("usage: lightning-pipe ") == 4, result.stdout  # each is its subcommand's parser


def test_the_console_script_runs_each_subcommand_and_names_an_unknown_one(capsys):
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    target = pyproject["project"]["scripts"]["lightning-pipe"]
    module, _, function = target.partition(":")
    main = getattr(importlib.import_module(module), function)
    for subcommand in ("plan", "export_pretrained", "consolidate_checkpoint", "trace"):
        with pytest.raises(SystemExit) as exit:
            main([subcommand, "--help"])
        assert exit.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: lightning-pipe {subcommand} ")
    main(["--help"])
    assert "consolidate_checkpoint" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown subcommand 'planner'; use one of plan, export_pretrained"):
        main(["planner"])


def test_a_checkpoint_written_before_the_folders_resumes_as_on_one_device(tmp_path):
    """Commit 6534a2b's 2-stage checkpoint resumes on 2 stages for a second epoch exactly as one device resumes it."""
    saved = tmp_path.parent / OLD_CHECKPOINT  # copied, so the run may write beside it
    saved.write_bytes((REPO_DATA / OLD_CHECKPOINT).read_bytes())
    checkpoint = torch.load(saved, weights_only=False)
    assert checkpoint["epoch"] == 0 and checkpoint["optimizer_states"][0]["state"], "an epoch's momentum"
    pipelined = tmp_path / "pipelined"
    launch("checkpoints_worker.py", {"devices": 2, "out": str(pipelined), "epochs": 2, "ckpt_path": str(saved)},
           pipelined)
    expected = fit_epochs(tmp_path / "single", 2, str(saved), devices=1)["state_dict"]
    initial = checkpoint["state_dict"]
    for rank in range(2):
        actual = torch.load(pipelined / f"rank{rank}.pt")["state_dict"]
        error = torch.sqrt(sum(((actual[k] - v) ** 2).sum() for k, v in expected.items()))
        change = torch.sqrt(sum(((v - initial[k]) ** 2).sum() for k, v in expected.items() if v.is_floating_point()))
        assert change > 0 and error / change < 1e-5, (rank, float(error / change))
