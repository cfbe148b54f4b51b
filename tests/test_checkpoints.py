"""Checkpoints hold the whole model as one device would save it: they load anywhere and resume on any stage count."""

from __future__ import annotations

import pytest
import torch

from helpers.launch import launch, run_python
from helpers.scenarios import fit_epochs


def relative_error(expected: dict, initial: dict, actual: dict) -> float:
    error = torch.sqrt(sum(((actual[k] - v) ** 2).sum() for k, v in expected.items()))
    change = torch.sqrt(sum(((v - initial[k]) ** 2).sum() for k, v in expected.items() if v.is_floating_point()))
    return float(error / change)


@pytest.fixture(scope="module")
def four_stage_epoch(tmp_path_factory):
    """One epoch on 4 stages; ModelCheckpoint saves last.ckpt at its end."""
    out = tmp_path_factory.mktemp("four")
    launch("checkpoints_worker.py", {"devices": 4, "out": str(out), "epochs": 1}, out)
    return out / "ckpt" / "last.ckpt"


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    return {epochs: fit_epochs(tmp / str(epochs), epochs)["state_dict"] for epochs in (0, 1, 2)}


def test_four_stage_checkpoint_resumes_on_two_stages_as_uninterrupted_training(four_stage_epoch, single_device, tmp_path):
    launch("checkpoints_worker.py", {"devices": 2, "out": str(tmp_path), "epochs": 2, "ckpt_path": str(four_stage_epoch)}, tmp_path)
    for rank in range(2):
        actual = torch.load(tmp_path / f"rank{rank}.pt")["state_dict"]
        assert relative_error(single_device[2], single_device[0], actual) < 1e-5


def test_checkpoint_of_two_replicas_resumes_on_one_replica_as_on_one_device(tmp_path):
    """The consolidated checkpoint does not depend on the replica count: written by 2 stages x 2 replicas, resumed
    on 2 stages x 1 replica, training continues exactly as one device resuming from the same file."""
    replicated = tmp_path / "replicated"
    spec = {"devices": 4, "out": str(replicated), "epochs": 1, "strategy": {"num_stages": 2}}
    launch("checkpoints_worker.py", spec, replicated)
    saved = replicated / "ckpt" / "last.ckpt"
    checkpoint = torch.load(saved, weights_only=False)
    assert checkpoint["optimizer_states"][0]["state"], "the checkpoint holds the optimizer's momentum"
    one_replica = tmp_path / "one_replica"
    launch("checkpoints_worker.py", {"devices": 2, "out": str(one_replica), "epochs": 2, "ckpt_path": str(saved)}, one_replica)
    expected = fit_epochs(tmp_path / "single", 2, str(saved), devices=1)["state_dict"]
    for rank in range(2):
        actual = torch.load(one_replica / f"rank{rank}.pt")["state_dict"]
        assert relative_error(expected, checkpoint["state_dict"], actual) < 1e-5


def test_resuming_without_the_optimizer_state_would_be_caught(four_stage_epoch, single_device, tmp_path):
    """Negative control: the comparison above sees a resume that loses the optimizer's momentum."""
    saved = torch.load(four_stage_epoch, weights_only=False)
    assert saved["optimizer_states"][0]["state"], "the checkpoint holds the optimizer's momentum"
    saved["optimizer_states"][0]["state"] = {}
    torch.save(saved, tmp_path / "no_momentum.ckpt")
    actual = fit_epochs(tmp_path, 2, str(tmp_path / "no_momentum.ckpt"), devices=1)["state_dict"]
    assert relative_error(single_device[2], single_device[0], actual) > 1e-3


def test_consolidated_checkpoint_loads_without_lightning_pipe(four_stage_epoch, single_device, tmp_path):
    torch.save(single_device[1], tmp_path / "expected.pt")
    script = f"""
import sys, torch
from helpers.models import ProjectModule
model = ProjectModule.load_from_checkpoint({str(four_stage_epoch)!r})
assert 'lightning_pipe' not in sys.modules, 'the checkpoint needed lightning_pipe to load'
expected = torch.load({str(tmp_path / 'expected.pt')!r})
state = model.state_dict()
assert list(state) == list(expected), (list(state), list(expected))
for key, value in expected.items():
    torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6)
print('loaded', len(state), 'tensors')
"""
    result = run_python("-c", script, cwd=tmp_path, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "loaded" in result.stdout


def test_sharded_checkpoint_of_four_stages_resumes_on_two(single_device, tmp_path):
    """save_distributed_checkpoint=True: each rank writes its own stage (torch.distributed.checkpoint)."""
    sharded = {"save_distributed_checkpoint": True}
    first, resumed = tmp_path / "four", tmp_path / "two"
    launch("checkpoints_worker.py", {"devices": 4, "out": str(first), "epochs": 1, "strategy": sharded}, first)
    checkpoint = first / "ckpt" / "last.ckpt"
    assert checkpoint.is_dir() and (checkpoint / ".metadata").is_file()
    assert len(list(checkpoint.glob("*.distcp"))) == 4  # one shard per rank, nothing gathered
    spec = {"devices": 2, "out": str(resumed), "epochs": 2, "ckpt_path": str(checkpoint), "strategy": sharded}
    launch("checkpoints_worker.py", spec, resumed)
    for rank in range(2):
        actual = torch.load(resumed / f"rank{rank}.pt")["state_dict"]
        assert relative_error(single_device[2], single_device[0], actual) < 1e-5
