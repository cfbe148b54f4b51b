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


DAMAGES = {  # name: (what is done to a whole checkpoint, what the refusal says)
    "file-missing": ("the part's file removed", r"is incomplete: '.*__0_0\.distcp', one rank's part, is missing"),
    "metadata-unreadable": ("the .metadata overwritten", r"is corrupt: '.*\.metadata' cannot be read \("),
    "record-unreadable": ("the part's record overwritten with zeros",
                          r"is corrupt: the record of part 'stage0-replica0' cannot be read from '.*__0_0\.distcp'"
                          r" where \.metadata places it"),
    "link-dangling": ("the step directory the link names removed", r"is incomplete: its link 'current' names"
                      r" 'step-4-\w+', which does not exist"),
}


@pytest.mark.parametrize("name", list(DAMAGES))
def test_a_damaged_checkpoint_is_refused_naming_the_file_and_the_complete_one_beside_it(name, tmp_path):
    import shutil

    from lightning_pipe.checkpoints.integrity import ShardedCheckpointError, check_sharded_checkpoint

    model, optimizer = trained()
    save_committed(tmp_path / "epoch=0.ckpt", model, optimizer, 2)
    path = tmp_path / "last.ckpt"
    save_committed(path, model, optimizer, 4)
    files = check_sharded_checkpoint(path).directory
    if name == "file-missing":
        (files / "__0_0.distcp").unlink()
    elif name == "metadata-unreadable":
        (files / ".metadata").write_bytes(b"not a pickle")
    elif name == "record-unreadable":
        from torch.distributed.checkpoint import FileSystemReader

        metadata = FileSystemReader(str(files)).read_metadata()
        (place,) = [p for index, p in metadata.storage_data.items() if index.fqn.startswith("parts/")]
        with open(files / place.relative_path, "r+b") as file:
            file.seek(place.offset)
            file.write(bytes(place.length))
    else:
        shutil.rmtree(files)
    with pytest.raises(ShardedCheckpointError, match=DAMAGES[name][1]) as refused:
        check_sharded_checkpoint(path)
    beside = tmp_path / "epoch=0.ckpt"
    assert f"The newest complete checkpoint beside it is {str(beside)!r} (global step 2)" in str(refused.value)


def test_a_sharded_save_to_a_remote_path_names_the_fix():
    from lightning_pipe.checkpoints.strategy_io import StageCheckpoints

    checkpoints = StageCheckpoints(None, object(), object(), num_stages=2, save_distributed_checkpoint=True)
    refused = "sharded checkpoints are written into a local .* save_distributed_checkpoint=False"
    with pytest.raises(ValueError, match=refused):
        checkpoints.write({}, "s3://bucket/last.ckpt", None, after_spawned_ranks=False)


def test_a_checkpoint_missing_a_part_of_its_layout_is_refused_naming_it(tmp_path):
    """Parts recorded by 2 stages, only stage 0's present (a hand-made checkpoint: a .metadata of a real save lists
    every rank's part)."""
    from lightning_pipe.checkpoints.integrity import (
        PartRecord,
        ShardedCheckpointError,
        check_sharded_checkpoint,
        part_entries,
    )

    model, optimizer = trained()
    record = PartRecord("0123456789ab", 4, 0, stage=0, replica=0, num_stages=2, num_replicas=1, model="digest")
    write_sharded(tmp_path / "last.ckpt", model, optimizer)
    checkpoint = {"state_dict": model.state_dict(), "optimizer_states": []}
    sharded.save(checkpoint, tmp_path / "half.ckpt", list(model.state_dict()), [], records=part_entries(record))
    with pytest.raises(ShardedCheckpointError, match=r"is incomplete: it was saved by 2 stages x 1 replicas, but the"
                       r" parts of stage 1 replica 0 are missing from"):
        check_sharded_checkpoint(tmp_path / "half.ckpt")


@pytest.mark.parametrize("moment", ["step moved in", "link about to switch"])
def test_a_crash_inside_the_commit_leaves_the_previous_checkpoint(moment, tmp_path):
    """The writer killed (SIGKILL) between moving the new step into the checkpoint and switching its link, or as the
    link is replaced: the checkpoint is the previous one, whole; the next save removes what the crash left."""
    import signal

    from lightning_pipe.checkpoints import commit
    from lightning_pipe.checkpoints.integrity import check_sharded_checkpoint

    model, optimizer = trained()
    path = tmp_path / "last.ckpt"
    save_committed(path, model, optimizer, 4)
    child = os.fork()
    if child == 0:  # the writer, killed inside the commit
        if moment == "step moved in":
            commit._point = lambda directory, target: os.kill(os.getpid(), signal.SIGKILL)
        else:
            commit.os.replace = lambda source, target: os.kill(os.getpid(), signal.SIGKILL)
        save_committed(path, model, optimizer, 8)
        os._exit(0)  # not reached
    _, status = os.waitpid(child, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, "the writer was not killed"
    assert check_sharded_checkpoint(path).global_step == 4
    left = sorted(entry.name for entry in path.iterdir())
    new_step = [name for name in left if name.startswith("step-8-")]
    expected = ["current", *([f".current-{new_step[0]}"] if moment == "link about to switch" else []), *new_step]
    assert new_step and sorted([*expected, os.readlink(path / "current")]) == left, left  # the new step not pointed at
    save_committed(path, model, optimizer, 12)
    assert check_sharded_checkpoint(path).global_step == 12 and len(list(path.iterdir())) == 2
