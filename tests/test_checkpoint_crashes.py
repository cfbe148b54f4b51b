"""A crash or a full disk during a sharded save loses nothing, and a sharded checkpoint that is not whole is refused
by name: real processes, a rank SIGKILLed inside ``torch.distributed.checkpoint``'s save, resumed training compared
with one device.

Launches (``workers/checkpoint_crashes_worker.py``): one per killed save (2 and 4 stages, three points each, and the
negative control that writes in place as saves did before), then one 2-stage launch that runs, in turn, the
refusals (each fails alike on every rank), a resume from every crash, and a fit whose save meets a full disk.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest
import torch

from helpers.compare import relative_weight_error
from helpers.launch import Finished, launch, started_together
from helpers.scenarios import fit_epochs
from lightning_pipe.checkpoints.integrity import STAGING, ShardedCheckpointError, check_sharded_checkpoint
from lightning_pipe.commands.consolidate_checkpoint import main as consolidate_main

LIMIT_S = 60  # every process of a crashed run gone, and every refusal raised, within a minute
MARKER = "LIGHTNING_PIPE_CHECKPOINT_CRASH_RUN"


@dataclass(frozen=True)
class Crash:
    """A save killed: ``stages`` ranks, global rank ``rank`` SIGKILLed at ``at`` in the run's ``save``-th save."""

    stages: int
    at: str
    rank: int
    save: int  # 3: epoch=1-step=8.ckpt, a new path; 4: last.ckpt, replacing epoch 0's
    in_place: bool = False  # the negative control: written into the checkpoint's own directory, as before


# Under the default launcher the last stage is global rank 0 (it writes the .metadata) and the first stage the highest.
CRASHES = {
    "2-before-shard": Crash(2, "before_shard", 1, 4),
    "2-mid-shard": Crash(2, "mid_shard", 0, 4),
    "2-before-metadata": Crash(2, "before_metadata", 0, 4),
    "4-before-shard": Crash(4, "before_shard", 2, 3),
    "4-mid-shard": Crash(4, "mid_shard", 3, 3),
    "4-before-metadata": Crash(4, "before_metadata", 0, 3),
}
IN_PLACE = Crash(2, "before_shard", 0, 4, in_place=True)  # rank 1's new part lands beside rank 0's old one
REFUSALS = {  # name: (what the refusal says, how the refused checkpoint is made from a crash's complete ones)
    "assembled": "is assembled from different saves: its parts disagree: stage 0 ('__1_0.distcp'): global step 8",
    "cut-short": "is corrupt: ",
    "no-metadata": "is incomplete: ",
    "interrupted": "is absent: its save was interrupted before every rank's part and the .metadata were written",
}


def crash(name: str, crash: Crash, tmp: Path) -> tuple[Finished, Path]:
    """Two epochs (saves 1-2 at epoch 0's end, 3-4 at epoch 1's), the crash's save killed."""
    out = tmp / name
    kill = {"at": crash.at, "rank": crash.rank, "save": crash.save}
    run = {"name": "crash", "epochs": 2, "ckpt_dir": str(out / "ckpt"), "kill": kill, "in_place": crash.in_place}
    finished = launch("checkpoint_crashes_worker.py", {"devices": crash.stages, "out": str(out), "runs": [run]}, out,
                      check=False, marker_variable=MARKER)
    return finished, out


@pytest.fixture(scope="module")
def crashes(tmp_path_factory) -> dict[str, tuple[Finished, Path]]:
    tmp = tmp_path_factory.mktemp("crashes")
    jobs = {name: partial(crash, name, case, tmp) for name, case in {**CRASHES, "in-place": IN_PLACE}.items()}
    futures = started_together(jobs, at_most=3)
    return {name: future.result() for name, future in futures.items()}


@pytest.fixture(scope="module")
def after_crashes(crashes, tmp_path_factory) -> dict:
    """What each crash left, read before anything else touches it, and the refused checkpoints made from it."""
    left = {name: _state_of(out / "ckpt") for name, (_, out) in crashes.items()}
    refusals = _make_refusals(crashes, tmp_path_factory.mktemp("refusals"))
    return {"left": left, "refusals": refusals,
            "hashes": {name: _hashes(path.parent) for name, (path, _) in refusals.items()}}


@pytest.fixture(scope="module")
def resumed(crashes, after_crashes, tmp_path_factory) -> Path:
    """One 2-stage launch: every refusal, then ``ckpt_path="last"`` from every crash (epoch 0's end) to the end of
    epoch 1, then a full disk."""
    out = tmp_path_factory.mktemp("resumed")
    runs = [{"name": f"refuse-{name}", "epochs": 3, "ckpt_dir": str(out / "unused" / name), "ckpt_path": str(path)}
            for name, (path, _) in after_crashes["refusals"].items()]
    runs += [{"name": f"resume-{name}", "epochs": 2, "ckpt_dir": str(crash_out / "ckpt"), "ckpt_path": "last"}
             for name, (_, crash_out) in crashes.items()]
    runs.append({"name": "full-disk", "epochs": 2, "ckpt_dir": str(out / "full-disk" / "ckpt"),
                 "full_disk": {"rank": 1, "save": 4, "bytes": 1024}})
    finished = launch("checkpoint_crashes_worker.py", {"devices": 2, "out": str(out), "runs": runs}, out,
                      check=False, timeout=600, marker_variable=MARKER)
    assert not finished.leftovers, f"processes {finished.leftovers} were still running at the launch's deadline"
    return out


@pytest.fixture(scope="module")
def one_device(tmp_path_factory) -> dict[int, dict]:
    tmp = tmp_path_factory.mktemp("one_device")
    return {epochs: fit_epochs(tmp / str(epochs), epochs)["state_dict"] for epochs in (0, 2)}


# ---- the tests -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CRASHES))
def test_rank_killed_inside_a_sharded_save_leaves_the_previous_checkpoint_which_resumes_as_on_one_device(
    name, crashes, after_crashes, resumed, one_device
):
    """The save killed at 2 or 4 stages, before a rank's part, while it is written, or before the .metadata: the
    previous checkpoint is whole and untouched where resume finds it, the interrupted one absent (its staging
    directory refused by name), and ``ckpt_path="last"`` continues exactly as one device; the resumed run's first
    save removes the staging directory."""
    finished, out = crashes[name]
    case = CRASHES[name]
    fault = _ended_fast(finished, out / "crash")
    assert (fault["at"], fault["save"]) == (case.at, case.save)
    left = after_crashes["left"][name]
    assert left["last.ckpt"] == 4, f"last.ckpt holds step {left['last.ckpt']}, not epoch 0's end (step 4)"
    if case.save == 4:  # last.ckpt's replacement was killed; epoch 1's own checkpoint was saved before it
        assert left["epoch=1-step=8.ckpt"] == 8
    else:  # epoch 1's checkpoint, a new path, was killed: absent; epoch 0's is still there
        assert "epoch=1-step=8.ckpt" not in left and left["epoch=0-step=4.ckpt"] == 4
    (staging,) = left["staging"]
    assert "is incomplete" in staging, staging  # what the interrupted save wrote, refused by name if read

    result = _ended(resumed / f"resume-{name}")
    for rank in (0, 1):
        assert result[rank]["ended"] == "finished", result[rank]
        weights = torch.load(resumed / f"resume-{name}" / f"rank{rank}.pt")["state_dict"]
        error = relative_weight_error(one_device[0], one_device[2], weights)
        print(f"{name}: rank {rank}'s resumed weights differ from one device's by {error:.1e} of their change")
        assert error < 1e-5
    assert not list((out / "ckpt").glob(f".*{STAGING}*")), "the next successful save left the staging directory"


def test_writing_in_place_would_fail_the_comparison(crashes, after_crashes, resumed, one_device):
    """Negative control: the same crash with every part written into the checkpoint's own directory, as sharded
    saves were before. Rank 1's new part lands beside rank 0's old one and the old .metadata; the checkpoint still
    loads (it records no parts), and training resumed from it ends far from one device's."""
    finished, out = crashes["in-place"]
    _ended_fast(finished, out / "crash")
    result = _ended(resumed / "resume-in-place")
    assert result[0]["ended"] == "finished", result[0]
    weights = torch.load(resumed / "resume-in-place" / "rank0.pt")["state_dict"]
    error = relative_weight_error(one_device[0], one_device[2], weights)
    print(f"in place: the resumed weights differ from one device's by {error:.1e} of their change")
    assert error > 1e-3


@pytest.mark.parametrize("name", list(REFUSALS))
def test_a_checkpoint_that_is_not_whole_is_refused_on_every_rank_naming_the_file_and_the_one_to_use(
    name, after_crashes, resumed
):
    """Parts of two saves put together, a part cut short, the .metadata missing, a save interrupted: resume refuses
    each on every rank within a minute, naming the checkpoint, what is wrong and the newest complete checkpoint
    beside it; nothing is deleted; the command refuses it alike."""
    path, beside = after_crashes["refusals"][name]
    ended = _ended(resumed / f"refuse-{name}")
    assert sorted(ended) == [0, 1], ended
    for rank, end in ended.items():
        assert end["ended"] == ShardedCheckpointError.__name__, (rank, end)
        message = end["message"]
        assert f"the sharded checkpoint {str(path)!r} {REFUSALS[name]}" in message, message
        assert f"The newest complete checkpoint beside it is {str(beside)!r}" in message, message
        print(f"{name}: rank {rank} refused it {end['time'] - end['started']:.1f} s after its fit started")
        assert end["time"] - end["started"] < LIMIT_S
    if name == "assembled":
        assert "stage 1 ('__0_0.distcp'): global step 4" in message, message
    assert _hashes(path.parent) == after_crashes["hashes"][name], "a refusal changed the files beside it"
    check_sharded_checkpoint(beside)
    if name != "interrupted":
        with pytest.raises(SystemExit) as ended:
            consolidate_main([str(path), str(path.parent / "out.ckpt")])
        assert ended.value.code == 1 and not (path.parent / "out.ckpt").exists()


def test_consolidate_names_the_parts_of_an_assembled_checkpoint(after_crashes, capsys):
    path, _ = after_crashes["refusals"]["assembled"]
    with pytest.raises(SystemExit):
        consolidate_main([str(path), str(path.parent / "out.ckpt")])
    said = capsys.readouterr().err
    assert "stage 0 ('__1_0.distcp'): global step 8" in said and "stage 1 ('__0_0.distcp'): global step 4" in said


def test_a_full_disk_fails_the_save_on_every_rank_naming_the_file_and_keeps_the_previous_checkpoint(resumed):
    """Stage 0's rank writes its part of epoch 1's last.ckpt under a file-size limit (what a full disk does to a
    write): every rank ends with the error naming the file and the checkpoint that still holds epoch 0; the partial
    directory is gone."""
    run = resumed / "full-disk"
    last = run / "ckpt" / "last.ckpt"
    ended = _ended(run)
    assert sorted(ended) == [0, 1], ended
    for rank, end in ended.items():
        assert end["ended"] == ShardedCheckpointError.__name__, (rank, end)
        message = end["message"]
        assert f"could not save the sharded checkpoint {str(last)!r}: stage 0 (rank 1) could not write" in message
        assert "__1_0.distcp' (1024 bytes written): the disk is full" in message, message
        assert f"{str(last)!r} (global step 4) still holds the checkpoint saved before it" in message, message
        assert f"Make room on the disk, then resume with ckpt_path={str(last)!r}" in message, message
    assert check_sharded_checkpoint(last).global_step == 4
    assert not list(last.parent.glob(f".*{STAGING}*"))


# ---- helpers -------------------------------------------------------------------------------------------------------


def _ended_fast(finished: Finished, out: Path) -> dict:
    """The kill fired, and every process was gone within a minute of it."""
    faults = [json.loads(path.read_text()) for path in out.glob("fault*.json")]
    assert len(faults) == 1, f"the kill did not fire:\n{finished.stderr[-4000:]}"
    assert finished.returncode != 0 and not finished.leftovers
    print(f"{out.parent.name}: every process gone {finished.gone - faults[0]['time']:.1f} s after the kill")
    assert finished.gone - faults[0]["time"] < LIMIT_S
    return faults[0]


def _ended(run: Path) -> dict[int, dict]:
    return {int(path.stem[len("rank"):]): json.loads(path.read_text()) for path in run.glob("rank*.json")}


def _state_of(ckpt: Path) -> dict:
    """The global step each checkpoint in ``ckpt`` holds (checked whole), and what reading each staging directory's
    step says."""
    state: dict = {"staging": []}
    for entry in sorted(ckpt.iterdir()):
        if STAGING in entry.name:
            for step in entry.iterdir():
                try:
                    check_sharded_checkpoint(step)
                except ShardedCheckpointError as error:
                    state["staging"].append(str(error))
        else:
            state[entry.name] = check_sharded_checkpoint(entry).global_step
    return state


def _make_refusals(crashes: dict, tmp: Path) -> dict[str, tuple[Path, Path]]:
    """Each refusal's checkpoint and the complete one beside it, from the 2-stage crash's epoch 0 (step 4) and 1
    (step 8) checkpoints, copied."""
    ckpt = crashes["2-before-shard"][1] / "ckpt"
    step4, step8 = check_sharded_checkpoint(ckpt / "last.ckpt"), check_sharded_checkpoint(ckpt / "epoch=1-step=8.ckpt")
    made = {}
    for name in REFUSALS:
        folder = tmp / name
        beside = folder / "epoch=0-step=4.ckpt"
        shutil.copytree(step4.path, beside, symlinks=True)
        refused = folder / "last.ckpt"
        if name != "interrupted":
            shutil.copytree((step4 if name == "assembled" else step8).path, refused, symlinks=True)
            files = check_sharded_checkpoint(refused).directory
            if name == "assembled":  # stage 0's part (rank 1's file) from step 8, the rest from step 4
                shutil.copyfile(step8.directory / "__1_0.distcp", files / "__1_0.distcp")
            elif name == "cut-short":
                shard = files / "__1_0.distcp"
                shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
            else:
                (files / ".metadata").unlink()
        else:  # what a save killed before its .metadata leaves: the staging directory beside a checkpoint never made
            staged = folder / f".last.ckpt{STAGING}0123456789ab" / step8.directory.name
            shutil.copytree(step8.directory, staged)
            (staged / ".metadata").unlink()
        made[name] = (refused, beside)
    return made


def _hashes(folder: Path) -> dict[str, str]:
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file() and not path.is_symlink()}
