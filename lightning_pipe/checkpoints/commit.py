"""A sharded checkpoint appears whole or not at all: every rank writes its part into a staging directory beside it,
and global rank 0 moves the new step into place once every part and the ``.metadata`` are written.

```text
ckpt/last.ckpt/current -> step-8-3fa2c1e07b9d          the link resume follows, replaced in one atomic step
ckpt/last.ckpt/step-8-3fa2c1e07b9d/.metadata, __0_0.distcp, __1_0.distcp
ckpt/.last.ckpt.saving-9b77e0c4a1f2/step-12-9b77e0c4a1f2/...   a save in progress, or interrupted: never read
```

``os.rename`` cannot replace a non-empty directory, so a checkpoint's directory stays where it is and only the link
inside it moves: the new step directory is renamed into it, then a new link replaces ``current``
(``os.replace``: atomic), then the old step directory goes. A checkpoint at a new path is the staging directory
itself, renamed into place whole. At every instant the path holds a complete checkpoint, the previous one until the
link switches and the new one from then on, so a crash anywhere leaves a checkpoint that resumes; what an
interrupted save wrote stays in its staging directory, which resume never reads and the next successful save in the
same directory removes. Lightning's ``ModelCheckpoint`` removes a checkpoint (``save_top_k``) as a directory, the
step inside with it; ``save_last="link"`` links ``last.ckpt`` to a checkpoint directory, which resume follows.

A rank that fails to write its part (a full disk, a write error) fails the save on every rank
(``torch.distributed.checkpoint`` gathers every rank's failure): each rank says which file and why, the staging
directory is removed, and nothing earlier is touched.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from lightning_pipe.checkpoints.integrity import (
    STAGING,
    PartRecord,
    ShardedCheckpointError,
    check_sharded_checkpoint,
    model_digest,
    newest_complete_beside,
    part_entries,
)
from lightning_pipe.checkpoints.sharded import COMMITTED
from lightning_pipe.checkpoints.sharded import save as save_sharded
from lightning_pipe.execution.process_groups import PipelineGroups, broadcast_object, decided_on_rank_zero
from lightning_pipe.reliability.root_cause import lost_a_peer

REPLACED = ".replaced-"  # a one-file checkpoint or a link set aside while a sharded one takes its path


class PartWriteError(OSError):
    """One rank could not write its part: the message names the file and why (the disk is full, ...)."""


def save_committed(
    checkpoint: dict[str, Any], path: str | Path, state_keys: list[str], parameter_order: list[str],
    groups: PipelineGroups,
) -> None:
    """Write ``checkpoint`` (this rank's share) as part of the sharded checkpoint ``path``, which appears, or is
    replaced, only once every rank's part is written (see the module). Called on every rank."""
    path = Path(path)
    rank, watchdog = groups.rank, groups.watchdog
    save = broadcast_object(uuid.uuid4().hex[:12] if rank == 0 else None, 0, rank, watchdog, "the checkpoint's save id")
    step = int(checkpoint.get("global_step", 0))
    staging = path.parent / f".{path.name}{STAGING}{save}"
    step_dir = staging / f"step-{step}-{save}"
    record = PartRecord(save, step, int(checkpoint.get("epoch", 0)), groups.stage, groups.replica,
                        groups.layout.num_stages, groups.layout.num_replicas, model_digest(state_keys, parameter_order))
    writer = _ExplainedWriter(step_dir, f"{record.describe()} (rank {rank})")
    try:
        save_sharded(checkpoint, step_dir, state_keys, parameter_order, part_entries(record), writer)
    except CheckpointException as failed:  # on every rank: torch gathers every rank's failure
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
        lost = _lost_peer(failed)
        # A rank lost (killed) or ended by the stall watchdog in the save's collectives: the lost-peer error, which
        # every rank turns into the lost stage's name or the watchdog's verdict (reliability.root_cause).
        raise ShardedCheckpointError(_failed_save(path, staging, failed)) from lost
    decided_on_rank_zero(lambda: _commit(staging, step_dir, path), f"commit the checkpoint {str(path)!r}", rank,
                         watchdog)


# ---- the commit, on global rank 0 ----------------------------------------------------------------------------------


def _commit(staging: Path, step_dir: Path, path: Path) -> None:
    """The written step becomes the checkpoint at ``path`` in one atomic step; then what it replaced, and what
    interrupted saves left beside it, are removed."""
    try:
        if path.is_dir() and not path.is_symlink():
            os.rename(step_dir, path / step_dir.name)
            _point(path, step_dir.name)  # the switch
            staging.rmdir()
        else:
            _point(staging, step_dir.name)
            # A one-file checkpoint, or a link (save_last="link"), where the new one goes: set aside, not deleted,
            # until the new one is in place.
            aside = path.parent / f".{path.name}{REPLACED}{step_dir.name}"
            replacing = os.path.lexists(path)
            if replacing:
                os.rename(path, aside)
            os.rename(staging, path)
            if replacing:
                _remove(aside)
        _sync(path)
        _sync(path.parent)
    except OSError as error:
        raise ShardedCheckpointError(
            f"could not put the sharded checkpoint {str(path)!r} in place: {_why(error)}. Every rank's part was"
            f" written into {str(staging)!r}; nothing earlier was deleted ({_previous(path)[0]})."
        ) from error
    for entry in path.iterdir():  # the step it replaced, and a legacy checkpoint's own files
        if entry.name not in (COMMITTED, step_dir.name):
            _remove(entry)
    for entry in [*path.parent.glob(f".*{STAGING}*"), *path.parent.glob(f".*{REPLACED}*")]:
        _remove(entry)


def _point(directory: Path, target: str) -> None:
    """``directory/current`` names ``target``, replacing the link it had in one atomic step."""
    link = directory / f".{COMMITTED}-{target}"
    os.symlink(target, link)
    os.replace(link, directory / COMMITTED)


def _remove(entry: Path) -> None:
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            entry.unlink()


def _sync(directory: Path) -> None:
    """The directory's entries (renames, links) on disk, as the files in it already are."""
    with contextlib.suppress(OSError):
        descriptor = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


# ---- a failed write, said ------------------------------------------------------------------------------------------


class _ExplainedWriter(FileSystemWriter):
    """torch's file-system writer, whose failure names the file and why (a full disk raises a bare ``unexpected
    pos`` error from the zip writer, with the ``OSError`` only in its context, which does not travel to the other
    ranks)."""

    def __init__(self, path: Path, part: str) -> None:
        super().__init__(str(path))
        self.part = part

    def write_data(self, plan: Any, planner: Any) -> Any:
        try:
            return super().write_data(plan, planner)
        except Exception as error:
            directory = Path(self.path)
            files = sorted(directory.glob(f"{plan.storage_data.prefix}*")) if directory.is_dir() else []
            where = (f"{str(files[-1])!r} ({files[-1].stat().st_size} bytes written)" if files
                     else f"its part into {str(directory)!r}")
            raise PartWriteError(f"{self.part} could not write {where}: {_why(error)}") from error


def _lost_peer(failed: CheckpointException) -> BaseException | None:
    """The failure of a rank that lost a peer in the save's collectives (its connection closed), if one did."""
    for wrapped in failed.failures.values():
        error = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        if isinstance(error, BaseException) and lost_a_peer(error):
            return error
    return None


def _why(error: BaseException) -> str:
    for cause in _chain(error):
        if isinstance(cause, OSError) and cause.errno in (errno.ENOSPC, errno.EDQUOT):
            return f"the disk is full ({cause.strerror})"
        if isinstance(cause, OSError) and cause.errno == errno.EFBIG:
            return ("the disk is full for this file (File too large: it reached the largest file the file system, or"
                    " this process's limit (ulimit -f), allows)")
        if isinstance(cause, OSError) and cause.errno is not None:
            return f"{cause.strerror} (errno {cause.errno})"
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _failed_save(path: Path, staging: Path, failed: CheckpointException) -> str:
    reasons = []
    for rank, wrapped in sorted(failed.failures.items()):
        error = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        reasons.append(str(error) if isinstance(error, PartWriteError)
                       else f"rank {rank} failed: {type(error).__name__}: {_why(error)}")
    full = "the disk is full" in " ".join(reasons)
    fix = "Make room on the disk" if full else "Mend the cause above"
    previous, resume = _previous(path)
    fix += f", then resume with ckpt_path={str(resume)!r}." if resume is not None else "."
    return (f"could not save the sharded checkpoint {str(path)!r}: {'; '.join(reasons)}. Nothing earlier was replaced"
            f" or deleted, and the partial directory {str(staging)!r} was removed: {previous}. {fix}")


def _previous(path: Path) -> tuple[str, Path | None]:
    """Which checkpoint to resume from after a failed save to ``path``, said, and its path (None: there is none)."""
    if path.is_file():
        return f"{str(path)!r} still holds the one-file checkpoint saved before it", path
    if path.is_dir():
        with contextlib.suppress(ShardedCheckpointError):
            return f"{check_sharded_checkpoint(path).describe()} still holds the checkpoint saved before it", path
    beside = newest_complete_beside(path)
    if beside is None:
        return "no earlier checkpoint is beside it", None
    return f"the newest complete checkpoint beside it is {beside.describe()}", beside.path
