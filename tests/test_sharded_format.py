"""The sharded checkpoint format: tensors and plain values only, read with the caller's ``weights_only``, and turned
into the single-device checkpoint file by the consolidate command (without processes: one shard)."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from lightning_pipe.checkpoints import sharded
from lightning_pipe.checkpoints.optimizer_states import name_optimizer_state
from lightning_pipe.checkpoints.whole_model import group_names


@pytest.fixture(autouse=True)
def _no_process_group_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        warnings.filterwarnings("ignore", ".*process group is not initialized.*")
        yield


def trained():
    """A model with two parameter groups (AdamW: tensor and step state), after one step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=0.1)
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    return model, optimizer


def write_sharded(path, model, optimizer, **extra):
    checkpoint = {"epoch": 3, "state_dict": model.state_dict(),
                  "optimizer_states": [name_optimizer_state(optimizer.state_dict(), group_names(model, optimizer))],
                  "hyper_parameters": {"lr": 0.1, "betas": (0.9, 0.99)}, **extra}
    order = [name for name, _ in model.named_parameters()]
    sharded.save(checkpoint, path, list(model.state_dict()), order)


def test_consolidated_file_is_the_single_device_checkpoint(tmp_path):
    model, optimizer = trained()
    write_sharded(tmp_path / "sharded", model, optimizer)
    out = tmp_path / "whole.ckpt"
    command = [sys.executable, "-m", "lightning_pipe.consolidate_checkpoint", str(tmp_path / "sharded"), str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    whole = torch.load(out, weights_only=True)
    assert list(whole) == ["epoch", "state_dict", "optimizer_states", "hyper_parameters"]
    assert whole["epoch"] == 3 and whole["hyper_parameters"] == {"lr": 0.1, "betas": (0.9, 0.99)}
    assert list(whole["state_dict"]) == list(model.state_dict())
    for key, value in model.state_dict().items():
        assert torch.equal(whole["state_dict"][key], value), key
    expected = optimizer.state_dict()  # numbered as on one device: group by group, in the model's order
    assert whole["optimizer_states"][0]["param_groups"] == expected["param_groups"]
    assert whole["optimizer_states"][0]["state"].keys() == expected["state"].keys()
    for index, entries in expected["state"].items():
        for entry, value in entries.items():
            assert torch.equal(whole["optimizer_states"][0]["state"][index][entry], value), (index, entry)


class RunsCode:
    """Unpickling this runs ``os.mkdir(marker)``: what a crafted checkpoint could do with any callable."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_crafted_sharded_checkpoint_is_refused_under_weights_only(tmp_path):
    model, optimizer = trained()
    marker = tmp_path / "code_ran"
    write_sharded(tmp_path / "crafted", model, optimizer, hyper_parameters=RunsCode(str(marker)))
    names = [group_names(model, optimizer)]
    refused = r"entry 'lightning' of the sharded checkpoint .*weights_only=True"
    with pytest.raises(pickle.UnpicklingError, match=refused):
        sharded.load(tmp_path / "crafted", set(model.state_dict()), names, weights_only=True)
    with pytest.raises(pickle.UnpicklingError, match="weights_only=True refuses"):
        sharded.consolidate(tmp_path / "crafted", tmp_path / "whole.ckpt", weights_only=True)
    assert not marker.exists()
    # Positive control: the checkpoint does run code when its source is trusted (weights_only=False).
    sharded.load(tmp_path / "crafted", set(model.state_dict()), names, weights_only=False)
    assert marker.is_dir()


def test_a_checkpoint_of_this_package_loads_under_weights_only(tmp_path):
    model, optimizer = trained()
    write_sharded(tmp_path / "plain", model, optimizer)
    names = [group_names(model, optimizer)]
    loaded = sharded.load(tmp_path / "plain", set(model.state_dict()), names, weights_only=True)
    assert loaded["epoch"] == 3 and loaded[sharded.SHARDED]
    for key, value in model.state_dict().items():
        assert torch.equal(loaded["state_dict"][key], value), key
    assert loaded["optimizer_states"][0]["param_groups"] == optimizer.state_dict()["param_groups"]


# ---- committed whole: the link, what a save replaces, what interrupted saves left ------------------------------------


def save_committed(path, model, optimizer, step):
    from lightning_pipe.checkpoints.commit import save_committed as save
    from lightning_pipe.execution.process_groups import PipelineGroups
    from lightning_pipe.partition.topology import PipelineLayout

    one_rank = PipelineGroups(PipelineLayout(1), 0, torch.device("cpu"), None, None, None, None)
    checkpoint = {"epoch": 0, "global_step": step, "state_dict": model.state_dict(),
                  "optimizer_states": [name_optimizer_state(optimizer.state_dict(), group_names(model, optimizer))]}
    save(checkpoint, path, list(model.state_dict()), [name for name, _ in model.named_parameters()], one_rank)


def test_a_save_replaces_a_checkpoint_by_switching_its_link_and_removes_what_it_replaced(tmp_path):
    """A checkpoint written in place (as before), then saved over twice: each save puts its step beside the link and
    switches it; the old step, the old files and a leftover of an interrupted save are gone once it is in place."""
    from lightning_pipe.checkpoints.integrity import STAGING, check_sharded_checkpoint

    model, optimizer = trained()
    path = tmp_path / "last.ckpt"
    write_sharded(path, model, optimizer)  # the layout of a save before this one: the files in the directory
    assert check_sharded_checkpoint(path).directory == path and check_sharded_checkpoint(path).global_step is None
    leftover = tmp_path / f".epoch=3.ckpt{STAGING}0123456789ab" / "step-9-0123456789ab"
    leftover.mkdir(parents=True)
    for step in (4, 8):
        save_committed(path, model, optimizer, step)
        checked = check_sharded_checkpoint(path)
        assert checked.global_step == step and checked.directory == path / os.readlink(path / "current")
        assert sorted(entry.name for entry in path.iterdir()) == ["current", checked.directory.name]
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["last.ckpt"]
    names = [group_names(model, optimizer)]
    loaded = sharded.load(path, set(model.state_dict()), names, weights_only=True)
    assert loaded["global_step"] == 8
    for key, value in model.state_dict().items():
        assert torch.equal(loaded["state_dict"][key], value), key


def test_a_one_file_checkpoint_at_the_path_is_replaced_by_the_sharded_one(tmp_path):
    from lightning_pipe.checkpoints.integrity import check_sharded_checkpoint

    model, optimizer = trained()
    path = tmp_path / "last.ckpt"
    torch.save({"epoch": 0}, path)
    save_committed(path, model, optimizer, 4)
    assert path.is_dir() and check_sharded_checkpoint(path).global_step == 4
    assert sorted(entry.name for entry in tmp_path.iterdir()) == ["last.ckpt"]
