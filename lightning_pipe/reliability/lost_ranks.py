"""Which ranks of a run are gone: every rank's host and process, published in the store when the ranks start, looked
up when a collective fails because a peer closed its connections.

A wait on one neighbour knows whom it lost (:class:`~lightning_pipe.execution.p2p.Link` names it); a collective over
many ranks does not: gloo says only "Connection reset by peer" with an address. A rank that ended without a Python
error (SIGKILL, the out-of-memory killer, a crash in native code) records no failure of its own
(:mod:`~lightning_pipe.reliability.root_cause`), so the ranks left find it here: a published process of their host
that is no longer running.
"""

from __future__ import annotations

import json
import os
import socket
import time
import traceback
from pathlib import Path

import torch.distributed as dist

_KEY = "lightning_pipe/process"
ENDING_S = 2.0  # how long a process whose connections closed may take to leave the process table
# What a rank was doing, from the functions of its traceback (innermost first wins): what a user recognises.
_ACTIVITIES = {
    "save_checkpoint": "saving a checkpoint", "dump_checkpoint": "saving a checkpoint",
    "load_checkpoint": "loading a checkpoint", "_restore_modules_and_callbacks": "loading a checkpoint",
}


def publish_process(name: str) -> None:
    """Publish this rank's host and process id under its global rank, with ``name`` (``"stage 0 (rank 1)"``)."""
    store = dist.distributed_c10d._get_default_store()
    record = {"host": socket.gethostname(), "pid": os.getpid(), "name": name}
    store.set(f"{_KEY}/{dist.get_rank()}", json.dumps(record))


def lost_ranks(wait_s: float = ENDING_S) -> list[str] | None:
    """The names of the published ranks on this host whose processes have ended; ``None`` where the store does not
    answer (it lives in global rank 0's process, or torchrun's agent: that one is gone too). Where none has ended
    yet, looks again for up to ``wait_s``: a killed process closes its connections while the kernel ends it, so its
    peers may fail before it has left the process table."""
    try:
        store = dist.distributed_c10d._get_default_store()
        keys = [f"{_KEY}/{rank}" for rank in range(dist.get_world_size())]
        records = [json.loads(store.get(key)) for key in keys if store.check([key])]
    except Exception:  # noqa: BLE001  (the store went with the process that held it)
        return None
    host = socket.gethostname()
    local = [record for record in records if record["host"] == host]
    deadline = time.monotonic() + wait_s
    while True:
        lost = [record["name"] for record in local if not _running(record["pid"])]
        if lost or time.monotonic() >= deadline:
            return lost
        time.sleep(0.05)


def lost_rank_message(error: BaseException, me: str) -> str:
    """What to say when a wait of ``me`` on several ranks failed (``error``) because one of them closed its
    connections: which rank is gone and what ``me`` was doing."""
    lost = lost_ranks()
    if lost is None:
        who = "global rank 0 (the run's store, which that process held, no longer answers)"
    else:
        who = " and ".join(lost) if lost else "another rank (one on another host, or one that closed its connections)"
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return (
        f"{me} lost {who} while {_activity(error)}: its process ended without a Python error (killed, e.g. by SIGKILL"
        " or the out-of-memory killer, or crashed in native code), so it said nothing itself; its log and the"
        f" system's (dmesg) may say why. Resume from the last complete checkpoint. ({first_line})"
    )


def _activity(error: BaseException) -> str:
    """What this rank was doing when ``error`` was raised, from its traceback's function names."""
    frames = traceback.extract_tb(error.__traceback__)
    for frame in reversed(frames):
        if frame.name in _ACTIVITIES:
            return _ACTIVITIES[frame.name]
    collective = next((f for f in reversed(frames) if f"torch{os.sep}distributed" in f.filename), None)
    return f"in torch.distributed's {collective.name}" if collective is not None else "waiting on the other ranks"


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, ended but not yet reaped by its parent, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux): whether a signal could reach it
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            pass
        return True
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
