"""A rank that loses a peer raises the peer's recorded exception, not the lost-peer error (one process, one store:
the multi-process runs of test_reliability.py show it across real ranks)."""

from __future__ import annotations

import base64
import json
import pickle
import socket
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch.distributed as dist

from lightning_pipe.reliability.lost_ranks import publish_process
from lightning_pipe.reliability.root_cause import PipelineCommunicationError
from lightning_pipe.reliability.root_cause import PipelineStageError, RecordedFailure, StageTraceback, raising_the_root_cause

KEY = "lightning_pipe/first_failure/test"


@pytest.fixture
def store(tmp_path):
    """A process group of one rank, whose store stands in for the one every rank of a run shares."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.distributed_c10d._get_default_store()
    dist.destroy_process_group()


class NeedsTwoArguments(Exception):
    """An exception that pickles but does not unpickle (its __init__ wants more than its message)."""

    def __init__(self, what: str, why: str) -> None:
        super().__init__(f"{what} failed: {why}")


def record_from_another_rank(store, error: Exception, rank: int = 1, stage: int = 0) -> None:
    """What rank ``rank`` leaves in the store when its own code raised ``error``."""
    try:
        raise error
    except Exception as raised:
        formatted = "".join(traceback.format_exception(raised))
    try:
        pickled = pickle.dumps(error)
        pickle.loads(pickled)
    except Exception:
        pickled = None
    failure = RecordedFailure(rank, stage, pickled, f"{type(error).__name__}: {error}", formatted)
    store.set(KEY, base64.b64encode(pickle.dumps(failure)).decode())


def lose_a_peer():
    raise PipelineCommunicationError("stage 1 (rank 0) lost stage 0 (rank 1) while waiting for the activation")


def test_a_lost_peer_error_becomes_the_recorded_exception_of_the_stage_that_raised(store):
    error = ValueError("Expected more than 1 value per channel when training, got input size torch.Size([1, 8])")
    error.add_note("raised by pipeline stage 0 (blocks 0..3) on micro-batch 5 of 8")
    record_from_another_rank(store, error)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel") as raised:
        raising_the_root_cause(lose_a_peer, None, KEY)
    notes = raised.value.__notes__
    assert notes[0] == "raised by pipeline stage 0 (blocks 0..3) on micro-batch 5 of 8"
    assert notes[1].startswith("raised on stage 0 (rank 1); rank 0 then lost that stage (PipelineCommunicationError)")
    cause = raised.value.__cause__
    assert isinstance(cause, StageTraceback) and "ValueError: Expected more than 1 value" in str(cause)
    assert str(cause).startswith("on stage 0 (rank 1):")


def test_an_exception_that_does_not_unpickle_arrives_as_its_type_and_message(store):
    record_from_another_rank(store, NeedsTwoArguments("the data loader", "disk full"), rank=2, stage=1)
    with pytest.raises(PipelineStageError) as raised:
        raising_the_root_cause(lose_a_peer, None, KEY)
    assert str(raised.value) == "NeedsTwoArguments: the data loader failed: disk full (raised on stage 1 (rank 2))"


def test_the_first_own_error_is_recorded_and_raised_unchanged(store):
    def fail():
        raise KeyError("missing column 'label'")

    with pytest.raises(KeyError) as raised:
        raising_the_root_cause(fail, None, KEY)
    assert not getattr(raised.value, "__notes__", None)
    recorded = pickle.loads(base64.b64decode(store.get(KEY)))
    assert (recorded.rank, recorded.summary) == (0, "KeyError: \"missing column 'label'\"")
    assert "in fail" in recorded.traceback

    def fail_later():
        raise RuntimeError("a second, later failure")

    with pytest.raises(RuntimeError):
        raising_the_root_cause(fail_later, None, KEY)
    assert pickle.loads(base64.b64decode(store.get(KEY))).summary.startswith("KeyError"), "the first one stays"


def test_a_lost_peer_without_a_record_stays_the_lost_peer_error(store):
    with pytest.raises(PipelineCommunicationError, match="lost stage 0"):
        raising_the_root_cause(lose_a_peer, None, KEY)  # e.g. the peer was killed: it recorded nothing
    assert not store.check([KEY]), "a lost-peer error is a consequence, never recorded as the cause"


def test_without_a_process_group_errors_pass_unchanged():
    assert not dist.is_initialized()
    with pytest.raises(PipelineCommunicationError):
        raising_the_root_cause(lose_a_peer, None, KEY)


def test_a_peer_killed_inside_a_collective_is_named_from_the_published_processes(store, monkeypatch):
    """gloo's error in a collective names no rank: the one whose published process has ended is named, with what
    this rank was doing. Rank 1 stands in as a child process that has ended (a zombie until reaped, as a killed rank
    is until its launcher reaps it); the one-rank group of this test counts two ranks for it."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    while Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.01)
    publish_process("stage 1 (rank 0)")  # this process: running
    record = {"host": socket.gethostname(), "pid": child.pid, "name": "stage 0 (rank 1)"}
    store.set("lightning_pipe/process/1", json.dumps(record))
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)

    def save_checkpoint():
        raise RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1922: Connection reset by peer")

    with pytest.raises(PipelineCommunicationError) as raised:
        raising_the_root_cause(save_checkpoint, None, KEY)
    child.wait()
    assert str(raised.value).startswith(
        "rank 0 lost stage 0 (rank 1) while saving a checkpoint: its process ended without a Python error"
    ), str(raised.value)
    assert str(raised.value).endswith("([gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1922: Connection reset by peer)")
    assert not store.check([KEY]), "a lost-peer error is a consequence, never recorded as the cause"
