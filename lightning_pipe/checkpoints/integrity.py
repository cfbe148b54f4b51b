"""Whether a sharded checkpoint on disk is whole: its ``.metadata``, every file it names complete, every rank's part
from one save; and, when it is not, the refusal that names the file, what is wrong and the checkpoint to use instead.

Every rank's part records which save wrote it, at which global step, and where it sits in the layout (stage,
replica, of how many), with a digest of the model's names (:class:`PartRecord`). A checkpoint whose parts come from
different saves (a crash between two ranks' writes into the same directory, or files copied together by hand) would
otherwise load without an error and train from a model that no step ever held. Each rank checks the whole
checkpoint by itself, with no collective, so every rank reaches the same verdict and raises the same error before
anything is loaded. A checkpoint written before parts were recorded is checked for its files only.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader

from lightning_pipe.checkpoints.sharded import COMMITTED, METADATA, committed_directory, read_local

PARTS = "parts/"  # the entries holding each rank's record: parts/stage<s>-replica<r>
STAGING = ".saving-"  # a save in progress, or interrupted: `.<name>.saving-<save>` beside the checkpoint


class ShardedCheckpointError(RuntimeError):
    """A sharded checkpoint that cannot be used (incomplete, corrupt, assembled from several saves), or a save that
    failed; the message names the file, what is wrong and the checkpoint to use instead."""


@dataclass(frozen=True)
class PartRecord:
    """What one rank's part of a sharded checkpoint says about itself."""

    save: str  # the save that wrote it: drawn by global rank 0, the same in every part of one save
    global_step: int
    epoch: int
    stage: int
    replica: int
    num_stages: int
    num_replicas: int
    model: str  # a digest of the whole model's state-dict keys and parameter names (model_digest)

    @property
    def key(self) -> str:
        return f"{PARTS}stage{self.stage}-replica{self.replica}"

    def describe(self) -> str:
        replica = f" replica {self.replica}" if self.num_replicas > 1 else ""
        return f"stage {self.stage}{replica}"


def part_entries(record: PartRecord) -> dict[str, Any]:
    """The checkpoint entry holding ``record`` (a plain dict: read under ``weights_only=True``)."""
    return {record.key: asdict(record)}


def model_digest(state_keys: Sequence[str], parameter_order: Sequence[str]) -> str:
    """The model a checkpoint belongs to, as a few bytes: its state-dict keys and parameter names, in order."""
    return hashlib.sha256(repr((list(state_keys), list(parameter_order))).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class CheckedCheckpoint:
    """A sharded checkpoint found whole."""

    path: Path  # as given
    directory: Path  # the directory holding its torch.distributed.checkpoint files
    parts: list[PartRecord]  # every rank's record; empty for a checkpoint written before parts were recorded

    @property
    def global_step(self) -> int | None:
        return self.parts[0].global_step if self.parts else None

    def describe(self) -> str:
        step = f" (global step {self.global_step})" if self.parts else ""
        return f"{str(self.path)!r}{step}"


class _Problem(Exception):
    """What is wrong with a checkpoint: ``verdict`` (``"incomplete"``, ``"corrupt"``, ...) and the detail."""

    def __init__(self, verdict: str, detail: str) -> None:
        super().__init__(verdict, detail)
        self.verdict, self.detail = verdict, detail


def check_sharded_checkpoint(path: str | Path) -> CheckedCheckpoint:
    """``path`` checked whole (see the module); a :class:`ShardedCheckpointError` that says what is wrong and names
    the newest complete checkpoint beside it otherwise. Reads ``.metadata``, the files' sizes and the parts' records
    (a few bytes each): no tensor."""
    path = Path(path)
    try:
        return _checked(path)
    except _Problem as problem:
        raise ShardedCheckpointError(refusal(path, problem.verdict, problem.detail)) from None


def refuse_interrupted_save(path: str | Path) -> None:
    """Raise if ``path`` does not exist but a save to it was interrupted (its staging directory is beside it)."""
    path = Path(path)
    if path.exists() or not path.parent.is_dir():
        return
    staged = sorted(entry.name for entry in path.parent.glob(f".{path.name}{STAGING}*"))
    if staged:
        detail = (f"its save was interrupted before every rank's part and the {METADATA} were written (what it"
                  f" wrote is in {staged[-1]!r}, which is never read)")
        raise ShardedCheckpointError(refusal(path, "absent", detail))


def refusal(path: Path, verdict: str, detail: str) -> str:
    """``the sharded checkpoint P is VERDICT: DETAIL.`` and the fix: the newest complete checkpoint beside it."""
    beside = newest_complete_beside(path)
    if beside is None:
        fix = "No complete checkpoint is beside it: start the run again without ckpt_path, or give another one."
    else:
        fix = f"The newest complete checkpoint beside it is {beside.describe()}: pass ckpt_path={str(beside.path)!r}."
    return f"the sharded checkpoint {str(path)!r} is {verdict}: {detail}. {fix}"


def newest_complete_beside(path: Path) -> CheckedCheckpoint | None:
    """The most recently written complete checkpoint in ``path``'s directory, ``path`` excepted: a sharded one that
    passes every check, or a one-file ``*.ckpt`` (Lightning writes those whole, by renaming a temporary file)."""
    found: list[tuple[float, CheckedCheckpoint]] = []
    for entry in path.parent.iterdir() if path.parent.is_dir() else ():
        if entry.name.startswith(".") or entry.name == path.name:
            continue
        if entry.is_dir():
            try:
                found.append((entry.stat().st_mtime, _checked(entry)))
            except (_Problem, OSError):
                continue
        elif entry.is_file() and entry.suffix == ".ckpt":
            found.append((entry.stat().st_mtime, CheckedCheckpoint(entry, entry, [])))
    return max(found, key=lambda item: item[0])[1] if found else None


# ---- the checks ----------------------------------------------------------------------------------------------------


def _checked(path: Path) -> CheckedCheckpoint:
    pointer = path / COMMITTED
    if pointer.is_symlink() and not pointer.is_dir():
        raise _Problem("incomplete", f"its link {COMMITTED!r} names {os.readlink(pointer)!r}, which does not exist")
    directory = committed_directory(path)
    metadata = _metadata(directory)
    _check_files(directory, metadata.storage_data.values())
    parts = _parts(directory, metadata)
    _check_parts_agree(directory, parts)
    return CheckedCheckpoint(path, directory, [record for record, _ in parts.values()])


def _metadata(directory: Path) -> Any:
    if not (directory / METADATA).is_file():
        written = sorted(entry.name for entry in directory.iterdir()) if directory.is_dir() else []
        shown = ", ".join(written[:6]) + (", ..." if len(written) > 6 else "")
        raise _Problem("incomplete", f"{str(directory / METADATA)!r} is missing (a save writes it last, once every"
                       f" rank's part is written: this one did not finish; the directory holds: {shown or 'nothing'})")
    try:
        return FileSystemReader(str(directory)).read_metadata()
    except Exception as error:  # noqa: BLE001  (unpickling a damaged file raises many kinds)
        raise _Problem("corrupt", f"{str(directory / METADATA)!r} cannot be read ({type(error).__name__}:"
                       f" {_first_line(error)})") from None


def _check_files(directory: Path, places: Any) -> None:
    """Every file ``.metadata`` names exists and is at least as long as the last entry it places in it."""
    needed: dict[str, int] = {}
    for place in places:
        needed[place.relative_path] = max(needed.get(place.relative_path, 0), place.offset + place.length)
    for name, size in sorted(needed.items()):
        file = directory / name
        if not file.is_file():
            raise _Problem("incomplete", f"{str(file)!r}, one rank's part, is missing")
        actual = file.stat().st_size
        if actual < size:
            raise _Problem("corrupt", f"{str(file)!r} is cut short: it holds {actual} bytes, and {METADATA} places"
                           f" entries up to byte {size} in it (a write that did not finish, or a copy that stopped)")


def _parts(directory: Path, metadata: Any) -> dict[str, tuple[PartRecord, str]]:
    """Each part's record and the file holding it, read where ``.metadata`` places it."""
    files = {index.fqn: place.relative_path for index, place in metadata.storage_data.items()}
    parts: dict[str, tuple[PartRecord, str]] = {}
    for key in sorted(k for k in metadata.state_dict_metadata if k.startswith(PARTS)):
        holder: dict[str, Any] = {key: None}
        try:
            read_local(directory, holder)
            record = PartRecord(**holder[key])
        except Exception as error:  # noqa: BLE001  (a damaged or foreign file fails in many ways)
            raise _Problem("corrupt", f"the record of part {key[len(PARTS):]!r} cannot be read from"
                           f" {str(directory / files[key])!r} where {METADATA} places it: the file does not belong"
                           f" with this {METADATA} (it was written by another save, or damaged)"
                           f" ({type(error).__name__}: {_first_line(error)})") from None
        parts[key] = (record, files[key])
    return parts


def _check_parts_agree(directory: Path, parts: dict[str, tuple[PartRecord, str]]) -> None:
    if not parts:
        return  # written before parts were recorded
    records = [record for record, _ in parts.values()]

    def listing(items: Sequence[tuple[PartRecord, str]]) -> str:
        return "; ".join(f"{record.describe()} ({file!r}): global step {record.global_step}, epoch {record.epoch},"
                         f" save {record.save}" for record, file in items)

    saves = {record.save for record in records}
    if len(saves) > 1 or len({record.model for record in records}) > 1:
        raise _Problem("assembled from different saves", f"its parts disagree: {listing(list(parts.values()))}")
    first = records[0]
    expected = {(s, r) for s in range(first.num_stages) for r in range(first.num_replicas)}
    present = {(record.stage, record.replica) for record in records}
    if present != expected:
        missing = ", ".join(f"stage {s} replica {r}" for s, r in sorted(expected - present))
        raise _Problem("incomplete", f"it was saved by {first.num_stages} stages x {first.num_replicas} replicas, but"
                       f" the parts of {missing} are missing from {str(directory / METADATA)!r} (present:"
                       f" {listing(list(parts.values()))})")


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else repr(error)
