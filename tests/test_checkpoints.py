"""Checkpoints hold the whole model as one device would save it: they load anywhere and resume on any stage count."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

from helpers.launch import launch, launches_started_with_first_test, run_python
from helpers.models import ProjectModule
from helpers.scenarios import fit_epochs
from lightning_pipe.checkpoints.sharded import committed_directory


def relative_error(expected: dict, initial: dict, actual: dict) -> float:
    error = torch.sqrt(sum(((actual[k] - v) ** 2).sum() for k, v in expected.items()))
    change = torch.sqrt(sum(((v - initial[k]) ** 2).sum() for k, v in expected.items() if v.is_floating_point()))
    return float(error / change)


def four_stages_then_two(out: Path) -> Path:
    """One epoch on 4 stages; ModelCheckpoint saves last.ckpt at its end, and every rank calls
    ``trainer.save_checkpoint(after_fit.ckpt)`` once fit has returned. Then 2 stages resume from after_fit.ckpt for a
    second epoch (into ``out/resumed``). The 4-stage run's last.ckpt."""
    launch("checkpoints_worker.py", {"devices": 4, "out": str(out), "epochs": 1, "save_after_fit": True}, out)
    resumed = out / "resumed"
    launch("checkpoints_worker.py", {"devices": 2, "out": str(resumed), "epochs": 2,
                                     "ckpt_path": str(out / "after_fit.ckpt")}, resumed)
    return out / "ckpt" / "last.ckpt"


def two_replicas_then_one(out: Path) -> Path:
    """One epoch on 2 stages x 2 replicas, then a second epoch resumed from its last.ckpt on 2 stages x 1 replica
    (into ``out/one_replica``). The replicated run's last.ckpt."""
    replicated = out / "replicated"
    launch("checkpoints_worker.py", {"devices": 4, "out": str(replicated), "epochs": 1,
                                     "strategy": {"num_stages": 2}}, replicated)
    saved = replicated / "ckpt" / "last.ckpt"
    one_replica = out / "one_replica"
    launch("checkpoints_worker.py", {"devices": 2, "out": str(one_replica), "epochs": 2, "ckpt_path": str(saved)},
           one_replica)
    return saved


# Both chains of launches, started together with the file's first test: the fits on one device run meanwhile.
launches = launches_started_with_first_test(("four_stage_epoch", "replicated_checkpoint"), lambda tmp: {
    "four": partial(four_stages_then_two, tmp.mktemp("four")),
    "replicas": partial(two_replicas_then_one, tmp.mktemp("replicas")),
})


@pytest.fixture(scope="module")
def four_stage_epoch(launches) -> Path:
    return launches["four"].result()


@pytest.fixture(scope="module")
def replicated_checkpoint(launches) -> Path:
    return launches["replicas"].result()


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("single")
    return {epochs: fit_epochs(tmp / str(epochs), epochs)["state_dict"] for epochs in (0, 1, 2)}


def test_checkpoint_saved_after_fit_holds_every_stage_and_resumes_on_two_stages(single_device, four_stage_epoch):
    """``trainer.save_checkpoint`` after fit: after teardown the optimizers are still per stage, and the file must
    hold all of them (it held rank 0's stage only); it equals the checkpoint ModelCheckpoint wrote at the end of the
    same epoch, and a 2-stage run resumed from it trains as uninterrupted training."""
    after_fit = four_stage_epoch.parent.parent / "after_fit.ckpt"
    saved, at_epoch_end = (torch.load(path, weights_only=False) for path in (after_fit, four_stage_epoch))
    parameters = [name for name, p in ProjectModule().named_parameters()]
    assert saved["optimizer_states"][0]["param_groups"][0]["params"] == list(range(len(parameters)))
    assert sorted(saved["optimizer_states"][0]["state"]) == list(range(len(parameters)))
    for index, entries in at_epoch_end["optimizer_states"][0]["state"].items():
        for entry, value in entries.items():
            assert torch.equal(saved["optimizer_states"][0]["state"][index][entry], value), (index, entry)
    assert saved["lr_schedulers"] == at_epoch_end["lr_schedulers"]
    assert saved["state_dict"].keys() == at_epoch_end["state_dict"].keys()
    for key, value in at_epoch_end["state_dict"].items():
        assert torch.equal(saved["state_dict"][key], value), key
    resumed = four_stage_epoch.parent.parent / "resumed"
    for rank in range(2):
        actual = torch.load(resumed / f"rank{rank}.pt")["state_dict"]
        assert relative_error(single_device[2], single_device[0], actual) < 1e-5


def test_checkpoint_of_two_replicas_resumes_on_one_replica_as_on_one_device(replicated_checkpoint, tmp_path):
    """The consolidated checkpoint does not depend on the replica count: written by 2 stages x 2 replicas, resumed
    on 2 stages x 1 replica, training continues exactly as one device resuming from the same file."""
    saved = replicated_checkpoint
    checkpoint = torch.load(saved, weights_only=False)
    assert checkpoint["optimizer_states"][0]["state"], "the checkpoint holds the optimizer's momentum"
    expected = fit_epochs(tmp_path / "single", 2, str(saved), devices=1)["state_dict"]
    for rank in range(2):
        actual = torch.load(saved.parents[2] / "one_replica" / f"rank{rank}.pt")["state_dict"]
        assert relative_error(expected, checkpoint["state_dict"], actual) < 1e-5


def test_resuming_with_the_momentum_of_one_stage_only_would_be_caught(four_stage_epoch, single_device, tmp_path):
    """Negative control: the comparisons above see a resume that loses the momentum of every stage but the last
    (what a checkpoint holding global rank 0's optimizer state alone would do)."""
    saved = torch.load(four_stage_epoch, weights_only=False)
    names = [name for name, p in ProjectModule().named_parameters()]
    # Rank 0's share on 4 stages: the last stage's Linear (layers 6-7 of net.model) and the replicated head.
    last_stage = {i for i, name in enumerate(names) if name.startswith(("net.model.6.", "head."))}
    state = saved["optimizer_states"][0]["state"]
    assert set(state) > last_stage, "the checkpoint holds every parameter's momentum"
    saved["optimizer_states"][0]["state"] = {i: value for i, value in state.items() if i in last_stage}
    torch.save(saved, tmp_path / "one_stage_momentum.ckpt")
    actual = fit_epochs(tmp_path, 2, str(tmp_path / "one_stage_momentum.ckpt"), devices=1)["state_dict"]
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


@pytest.mark.slow  # ~40 s; another stage count: test_checkpoint_saved_after_fit_holds_every_stage_and_resumes_on_two_stages; sharded: test_exactness.py
def test_sharded_checkpoint_of_four_stages_resumes_on_two(single_device, tmp_path):
    """save_distributed_checkpoint=True: each rank writes its own stage (torch.distributed.checkpoint)."""
    sharded = {"save_distributed_checkpoint": True}
    first, resumed = tmp_path / "four", tmp_path / "two"
    launch("checkpoints_worker.py", {"devices": 4, "out": str(first), "epochs": 1, "strategy": sharded}, first)
    checkpoint = first / "ckpt" / "last.ckpt"
    files = committed_directory(checkpoint)  # the step directory its `current` link names
    assert (files / ".metadata").is_file()
    assert len(list(files.glob("*.distcp"))) == 4  # one shard per rank, nothing gathered
    spec = {"devices": 2, "out": str(resumed), "epochs": 2, "ckpt_path": str(checkpoint), "strategy": sharded}
    launch("checkpoints_worker.py", spec, resumed)
    for rank in range(2):
        actual = torch.load(resumed / f"rank{rank}.pt")["state_dict"]
        assert relative_error(single_device[2], single_device[0], actual) < 1e-5
