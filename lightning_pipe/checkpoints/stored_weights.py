"""Weights stored in files, read a tensor at a time: what a checkpoint holds, and only the tensors asked for.

One interface over the formats a model's weights come in:

* a Hugging Face model directory (``model.safetensors``, or shards listed in ``model.safetensors.index.json``) or a
  ``.safetensors`` file: read with the ``safetensors`` library, which maps each file and reads single tensors;
* a PyTorch file (``pytorch_model.bin``, shards listed in ``pytorch_model.bin.index.json``, any ``torch.save``d state
  dict, or this project's consolidated checkpoint, whose ``state_dict`` it reads): ``torch.load(mmap=True,
  weights_only=True)`` maps it, so a tensor takes memory only when it is copied out;
* this project's sharded checkpoint (a ``torch.distributed.checkpoint`` directory): only the entries asked for.

:func:`open_stored_weights` reads the index (names, shapes, dtypes, which file holds what) and nothing else;
:meth:`StoredWeights.read_into` copies the named tensors into the caller's tensors, one file at a time.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_FILE = "pytorch_model.bin"
TORCH_INDEX = "pytorch_model.bin.index.json"
SHARDED_CHECKPOINT_MARK = ".metadata"  # a torch.distributed.checkpoint directory (see lightning_pipe.checkpoints.sharded)
SHARDED_CHECKPOINT_LINK = "current"  # a sharded checkpoint's link to the step directory holding its files
# The dtype names of the safetensors format (its specification), as torch dtypes.
SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class StoredTensor:
    """What the index says of one stored tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    file: str  # the file that holds it, relative to the checkpoint (its one file: its name)


class StoredWeights:
    """The tensors of one checkpoint, by name; read only when asked (:meth:`read_into`)."""

    def __init__(self, path: Path, kind: str, entries: dict[str, StoredTensor]) -> None:
        self.path, self.kind, self.entries = path, kind, entries

    def describe(self) -> str:
        """``'/models/gpt2' (safetensors, 2 files, 148 tensors)'``: for messages."""
        files = len({entry.file for entry in self.entries.values()})
        return f"{str(self.path)!r} ({self.kind}, {files} file{'s' * (files != 1)}, {len(self.entries)} tensors)"

    def files(self) -> list[list[str]]:
        """The stored names grouped by the file that holds them, in the order of the files' names."""
        grouped: dict[str, list[str]] = {}
        for name, entry in self.entries.items():
            grouped.setdefault(entry.file, []).append(name)
        return [grouped[file] for file in sorted(grouped)]

    def read_into(self, targets: Mapping[str, Sequence[Tensor]]) -> None:
        """Copy each named stored tensor into its target tensors (cast to their dtype and device, as ``copy_``
        does), one file at a time; nothing else is read."""
        by_file: dict[str, list[str]] = {}
        for name in targets:
            by_file.setdefault(self.entries[name].file, []).append(name)
        for file, names in sorted(by_file.items()):
            self._read_file(file, {name: targets[name] for name in names})

    def _read_file(self, file: str, targets: Mapping[str, Sequence[Tensor]]) -> None:
        raise NotImplementedError


def open_stored_weights(path: str | Path) -> StoredWeights:
    """The index of the checkpoint at ``path`` (see the module's docstring for the formats); a ``ValueError``
    naming what was looked for when ``path`` holds none of them."""
    path = Path(path)
    if path.is_dir():
        if _is_sharded_checkpoint(path):
            return _ShardedCheckpoint.open(path)
        for name, opener in ((SAFETENSORS_INDEX, _Safetensors.from_index), (SAFETENSORS_FILE, _Safetensors.from_file),
                             (TORCH_INDEX, _TorchFiles.from_index), (TORCH_FILE, _TorchFiles.from_file)):
            if (path / name).is_file():
                return opener(path / name)
        raise ValueError(
            f"{str(path)!r} holds no weights this package reads: no {SAFETENSORS_INDEX}, {SAFETENSORS_FILE},"
            f" {TORCH_INDEX} or {TORCH_FILE} (a Hugging Face model directory), and no {SHARDED_CHECKPOINT_MARK} (a"
            " sharded checkpoint of this package); give a directory holding one of them, or the weights file itself."
        )
    if not path.is_file():
        raise ValueError(f"{str(path)!r} does not exist; give a model directory or a weights file.")
    if path.name.endswith(".index.json"):
        return _Safetensors.from_index(path) if ".safetensors" in path.name else _TorchFiles.from_index(path)
    if path.suffix == ".safetensors":
        return _Safetensors.from_file(path)
    return _TorchFiles.from_file(path)


def check_stored_weights_path(path: str | Path) -> None:
    """Raise the ``ValueError`` of :func:`open_stored_weights` if ``path`` holds no weights it reads; reads no
    tensor, and no more than a directory listing for a directory."""
    path = Path(path)
    if path.is_dir():
        marks = (SAFETENSORS_INDEX, SAFETENSORS_FILE, TORCH_INDEX, TORCH_FILE)
        if not (_is_sharded_checkpoint(path) or any((path / mark).is_file() for mark in marks)):
            open_stored_weights(path)  # raises, naming what it looked for
    elif not path.is_file():
        open_stored_weights(path)


# ---- safetensors ---------------------------------------------------------------------------------------------------


class _Safetensors(StoredWeights):
    @classmethod
    def from_file(cls, file: Path) -> StoredWeights:
        return cls(file.parent, "safetensors", _safetensors_entries(file, file.name))

    @classmethod
    def from_index(cls, index: Path) -> StoredWeights:
        entries: dict[str, StoredTensor] = {}
        for file in sorted(set(_weight_map(index).values())):
            entries.update(_safetensors_entries(index.parent / file, file))
        return cls(index.parent, "safetensors", entries)

    def _read_file(self, file: str, targets: Mapping[str, Sequence[Tensor]]) -> None:
        with safe_open(str(self.path / file), framework="pt", device="cpu") as stored:
            for name, tensors in targets.items():
                value = stored.get_tensor(name)
                for tensor in tensors:
                    tensor.copy_(value)
                del value  # one tensor in flight at a time


def _safetensors_entries(file: Path, relative: str) -> dict[str, StoredTensor]:
    """The header of one safetensors file: no tensor data is read."""
    with safe_open(str(file), framework="pt", device="cpu") as stored:
        entries = {}
        for name in stored.keys():
            header = stored.get_slice(name)
            entries[name] = StoredTensor(tuple(header.get_shape()), SAFETENSORS_DTYPES[header.get_dtype()], relative)
    return entries


def _weight_map(index: Path) -> dict[str, str]:
    """A Hugging Face index's ``weight_map``: stored name -> file, relative to the index's directory."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError) as error:
        raise ValueError(
            f"{str(index)!r} is not a Hugging Face weights index (a JSON object with a 'weight_map' from tensor names"
            f" to files): {error!r}; write it with save_pretrained, or give one weights file instead."
        ) from error
    return dict(weight_map)


# ---- PyTorch files -------------------------------------------------------------------------------------------------


class _TorchFiles(StoredWeights):
    """``torch.save``d state dicts, memory-mapped: the index comes from the mapped tensors' metadata."""

    def __init__(self, path: Path, kind: str, entries: dict[str, StoredTensor]) -> None:
        super().__init__(path, kind, entries)
        self._mapped: dict[str, dict[str, Tensor]] = {}

    @classmethod
    def from_file(cls, file: Path) -> StoredWeights:
        return cls._of({file.name: file}, file.parent)

    @classmethod
    def from_index(cls, index: Path) -> StoredWeights:
        files = sorted(set(_weight_map(index).values()))
        return cls._of({file: index.parent / file for file in files}, index.parent)

    @classmethod
    def _of(cls, files: dict[str, Path], directory: Path) -> StoredWeights:
        weights = cls(directory, "PyTorch state dict, memory-mapped", {})
        for relative, file in files.items():
            state = _mapped_state_dict(file)
            weights._mapped[relative] = state
            weights.entries.update(
                {name: StoredTensor(tuple(t.shape), t.dtype, relative) for name, t in state.items()}
            )
        return weights

    def _read_file(self, file: str, targets: Mapping[str, Sequence[Tensor]]) -> None:
        state = self._mapped[file]
        for name, tensors in targets.items():
            for tensor in tensors:
                tensor.copy_(state[name])  # the pages of this tensor alone are read from the mapping


def _mapped_state_dict(file: Path) -> dict[str, Tensor]:
    """The tensors of a ``torch.save``d state dict, or of a Lightning checkpoint's ``state_dict``, memory-mapped."""
    try:
        loaded = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    except Exception as error:  # noqa: BLE001  (torch raises many kinds; all mean the same to the user)
        raise ValueError(
            f"{str(file)!r} could not be read as a PyTorch weights file with torch.load(mmap=True, weights_only=True):"
            f" {str(error).splitlines()[0]}; save the state dict with torch.save in the default (zip) format, or"
            " as safetensors."
        ) from error
    if isinstance(loaded, Mapping) and isinstance(loaded.get("state_dict"), Mapping):
        loaded = loaded["state_dict"]  # a Lightning checkpoint
    if not isinstance(loaded, Mapping) or not all(isinstance(value, Tensor) for value in loaded.values()):
        raise ValueError(
            f"{str(file)!r} holds a {type(loaded).__name__}, not a state dict (tensor names to tensors) nor a Lightning"
            " checkpoint; save model.state_dict() with torch.save."
        )
    return dict(loaded)


# ---- this project's sharded checkpoint -----------------------------------------------------------------------------


class _ShardedCheckpoint(StoredWeights):
    """A sharded checkpoint of this package: its ``model/<key>`` entries, read with torch.distributed.checkpoint."""

    @classmethod
    def open(cls, path: Path) -> StoredWeights:
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from lightning_pipe.checkpoints.integrity import check_sharded_checkpoint

        path = check_sharded_checkpoint(path).directory  # refused here if it is not whole
        metadata = FileSystemReader(str(path)).read_metadata()
        files = {index.fqn: storage.relative_path for index, storage in metadata.storage_data.items()}
        entries = {
            key[len("model/"):]: StoredTensor(tuple(meta.size), meta.properties.dtype, files[key])
            for key, meta in metadata.state_dict_metadata.items()
            if key.startswith("model/") and isinstance(meta, TensorStorageMetadata)
        }
        return cls(path, "sharded checkpoint of lightning_pipe", entries)

    def _read_file(self, file: str, targets: Mapping[str, Sequence[Tensor]]) -> None:
        from lightning_pipe.checkpoints.sharded import read_entries

        first = {f"model/{name}": tensors[0] for name, tensors in targets.items()}
        read_entries(self.path, first)  # straight into the first target of each: no copy in between
        for name, tensors in targets.items():
            for tensor in tensors[1:]:
                tensor.copy_(tensors[0])


def _is_sharded_checkpoint(path: Path) -> bool:
    """A sharded checkpoint of this package: its files, or the link to them (see lightning_pipe.checkpoints.sharded)."""
    return (path / SHARDED_CHECKPOINT_MARK).is_file() or (path / SHARDED_CHECKPOINT_LINK).is_symlink()


def read_tensors(weights: StoredWeights, names: Iterable[str]) -> dict[str, Tensor]:
    """The named stored tensors, each as stored (its shape and dtype), on the CPU."""
    tensors = {name: torch.empty(weights.entries[name].shape, dtype=weights.entries[name].dtype) for name in names}
    weights.read_into({name: [tensor] for name, tensor in tensors.items()})
    return tensors


def describe_names(names: Sequence[Any], shown: int = 5, quoted: bool = True) -> str:
    """``['a', 'b', 'c', ...] (12)``: the first few of a list and its length, for messages."""
    first = ", ".join(repr(name) if quoted else str(name) for name in names[:shown])
    return f"[{first}{', ...' if len(names) > shown else ''}] ({len(names)})"
