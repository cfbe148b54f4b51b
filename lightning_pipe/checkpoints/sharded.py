"""Sharded checkpoints through ``torch.distributed.checkpoint``: each rank writes and reads only its own stage.

The default for a model built on the meta device, and ``GPipeStrategy(save_distributed_checkpoint=True)`` for any
model: nothing is gathered on one host. A stage sharded over its replicas (``data_parallel="shard"``, FSDP2) writes
its DTensors as they are, each replica its shard's rows, and reads into them the same way (``torch.distributed.
checkpoint`` reshards what another layout wrote). Keys are named after the whole model, never after a rank, so a
checkpoint saved with any stage count (and any replica count, sharded or not) loads with any other:

* ``model/<state-dict key>``: weights (a parameter held by every stage is written once);
* ``optimizer<i>/state/<parameter name>/<entry>``: the optimizer state of each parameter (momentum, ``step``...);
* ``optimizer<i>/group/<parameter name>``: the index of the parameter group that holds the parameter;
* ``optimizer<i>/hyper``: the parameter groups' hyper-parameters, the same on every stage;
* ``order``: the whole model's state-dict keys and parameter names, in order (to number a consolidated file);
* ``lightning``: everything else Lightning saves (loops, callbacks, schedulers, hyper-parameters).

* ``parts/stage<s>-replica<r>``: what each rank's part says about itself (which save wrote it, its step, the layout),
  written by that rank (see :mod:`lightning_pipe.checkpoints.integrity`).

Every entry is a tensor or a plain value (numbers, strings, lists, dicts): they are read with the caller's
``weights_only``, so a checkpoint that holds other objects is refused under ``weights_only=True``, as
``torch.load`` refuses them. :func:`consolidate` writes one file from a sharded checkpoint, one stage at a time.

On disk a checkpoint is a directory whose ``current`` link names the step directory holding the
``torch.distributed.checkpoint`` files (``current -> step-8-<save>``), so that a new save replaces it by switching
the link (:mod:`lightning_pipe.checkpoints.commit`); a directory holding ``.metadata`` itself (written before, or by
``torch.distributed.checkpoint`` directly) is read as it is.
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.tensor import DTensor

from lightning_pipe.checkpoints.optimizer_states import NamedOptimizerState, global_group_names, merge_optimizer_states

SHARDED = "gpipe_sharded"  # marks a checkpoint dict that holds only this rank's share
METADATA = ".metadata"  # torch.distributed.checkpoint's index of every entry, written last
COMMITTED = "current"  # the link, in a checkpoint directory, to the step directory that holds its files


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a sharded checkpoint, whole or not: a checkpoint directory (one-file checkpoints are
    files)."""
    return Path(path).is_dir()


def committed_directory(path: str | Path) -> Path:
    """The directory whose files ``torch.distributed.checkpoint`` reads: the step directory the checkpoint's
    ``current`` link names, else ``path`` itself."""
    path = Path(path)
    pointer = path / COMMITTED
    return path / os.readlink(pointer) if pointer.is_symlink() else path


# ---- a rank's share ------------------------------------------------------------------------------------------------


def save(
    checkpoint: dict[str, Any],
    path: str | Path,
    state_keys: list[str],
    parameter_order: list[str],
    records: Mapping[str, Any] | None = None,
    storage_writer: dcp.StorageWriter | None = None,
) -> None:
    """Write this rank's share into the directory ``path`` (through ``storage_writer`` if given);
    ``checkpoint["optimizer_states"]`` holds :class:`NamedOptimizerState` objects. ``state_keys`` and
    ``parameter_order`` are the whole model's, in order; ``records`` are entries of this rank's own (its part's
    record)."""
    flat: dict[str, Any] = {f"model/{key}": value for key, value in checkpoint["state_dict"].items()}
    for i, named in enumerate(checkpoint.get("optimizer_states", [])):
        for name, entries in named.state.items():
            for entry, value in entries.items():
                flat[f"optimizer{i}/state/{name}/{entry}"] = value
        for g, group in enumerate(named.groups):
            flat.update({f"optimizer{i}/group/{name}": g for name in group["params"]})
        flat[f"optimizer{i}/hyper"] = [_hyper(group) for group in named.groups]
    flat["order"] = {"state_keys": list(state_keys), "parameter_order": list(parameter_order),
                     "checkpoint": list(checkpoint)}
    flat["lightning"] = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    flat.update(records or {})
    # Not flattened: a dict entry is stored as one value, so that its keys need not be valid names.
    planner = DefaultSavePlanner(flatten_state_dict=False)
    if storage_writer is None:
        dcp.save(flat, checkpoint_id=str(path), planner=planner)
    else:
        dcp.save(flat, storage_writer=storage_writer, planner=planner)


def load(
    path: str | Path, state_keys: set[str], optimizer_names: list[list[list[str]]], weights_only: bool | None = None,
    like: Mapping[str, DTensor] | None = None, optimizer_like: Mapping[str, DTensor] | None = None,
) -> dict[str, Any]:
    """This rank's share: weights for ``state_keys`` and, per optimizer, the state of its parameter groups'
    names (``optimizer_names[i]``), numbered as the local optimizer numbers them. Nothing else is read.
    ``weights_only`` as for ``torch.load`` (``None``: torch's default).

    A weight that is sharded here (``like[key]``, a DTensor: a stage sharded over its replicas) is read as a DTensor
    sharded alike, and so is the optimizer state of the parameter's shape of one (``optimizer_like[name]``): each
    rank reads only its shard, whatever layout wrote the checkpoint."""
    like, optimizer_like = like or {}, optimizer_like or {}
    path = committed_directory(path)
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    local_names = [{name for group in groups for name in group} for groups in optimizer_names]
    wanted: dict[str, Any] = {}
    for key, meta in metadata.items():
        parts = key.split("/")
        if parts[0] == "model" and key[len("model/") :] in state_keys:
            wanted[key] = _empty(meta, like.get(key[len("model/") :]))
        elif parts[0].startswith("optimizer") and parts[1] == "state" and parts[2] in local_names[_index(parts[0])]:
            wanted[key] = _empty(meta, optimizer_like.get(parts[2]))
        elif key == "lightning" or (parts[0].startswith("optimizer") and parts[1] == "hyper"):
            wanted[key] = _empty(meta)
    _read(path, wanted, weights_only)
    checkpoint = dict(wanted.pop("lightning"))
    checkpoint["state_dict"] = {k[len("model/") :]: v for k, v in wanted.items() if k.startswith("model/")}
    checkpoint["optimizer_states"] = [
        _local_optimizer_state(wanted, i, groups) for i, groups in enumerate(optimizer_names)
    ]
    checkpoint[SHARDED] = True
    return checkpoint


def _local_optimizer_state(flat: dict[str, Any], i: int, groups: list[list[str]]) -> dict[str, Any]:
    hyper = flat[f"optimizer{i}/hyper"]
    if len(hyper) != len(groups):
        raise ValueError(
            f"the checkpoint's optimizer {i} has {len(hyper)} parameter groups but this model's has {len(groups)};"
            " load it with the configure_optimizers that saved it."
        )
    by_name = _states_by_name(flat, i)
    state: dict[int, dict[str, Any]] = {}
    param_groups, index = [], 0
    for names, group in zip(groups, hyper):
        param_groups.append({**group, "params": list(range(index, index + len(names)))})
        for name in names:
            if name in by_name:
                state[index] = by_name[name]
            index += 1
    return {"state": state, "param_groups": param_groups}


# ---- one file from the shards --------------------------------------------------------------------------------------


def consolidate(path: str | Path, out: str | Path, weights_only: bool | None = None) -> None:
    """Write the sharded checkpoint ``path`` as one checkpoint file ``out``, numbered as one device numbers it: the
    file a gathered checkpoint would be, loadable with ``torch.load`` or ``load_from_checkpoint`` anywhere.

    The file is laid out first with every tensor's place reserved and nothing in it (``torch.serialization.skip_data``
    over fake tensors); then the tensors of one shard (one rank's stage) at a time are read and written into their
    places through a shared memory map, which is dropped before the next shard. Peak memory: about one stage.
    """
    path = committed_directory(path)
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    entries = metadata.state_dict_metadata
    values = {key: None for key, meta in entries.items() if not isinstance(meta, TensorStorageMetadata)}
    _read(path, values, weights_only)
    with FakeTensorMode():
        values.update({key: _empty(meta) for key, meta in entries.items() if isinstance(meta, TensorStorageMetadata)})
    checkpoint, places = _consolidated_layout(values)
    partial = Path(f"{out}.partial")
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save(checkpoint, partial)
    del checkpoint
    shards: dict[str, list[str]] = defaultdict(list)
    listed: set[str] = set()
    for index, storage in metadata.storage_data.items():
        # A tensor sharded over replicas (a DTensor) lies in several ranks' files: read whole, with the first.
        if index.fqn in places and index.fqn not in listed:
            listed.add(index.fqn)
            shards[storage.relative_path].append(index.fqn)
    for keys in shards.values():
        stage = {key: _empty(entries[key]) for key in keys}
        _read(path, stage, weights_only)
        with torch.serialization.set_default_mmap_options(mmap.MAP_SHARED):
            target = torch.load(partial, mmap=True, map_location="cpu", weights_only=weights_only)
        for key in list(stage):  # each tensor freed once written: the shard is held once, not twice
            _at(target, places[key]).copy_(stage.pop(key))
        del target  # unmaps the file: the written pages leave this process
    os.replace(partial, out)


def _consolidated_layout(values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, tuple[Any, ...]]]:
    """The consolidated checkpoint built from the sharded entries ``values`` (tensors fake), and where in it each
    tensor entry goes (``key -> path``)."""
    order = values["order"]
    places: dict[str, tuple[Any, ...]] = {}
    state_dict = {}
    for key in order["state_keys"]:
        if f"model/{key}" in values:
            state_dict[key] = values[f"model/{key}"]
            places[f"model/{key}"] = ("state_dict", key)
    optimizer_states = []
    count = sum(1 for key in values if key.startswith("optimizer") and key.endswith("/hyper"))
    for i in range(count):
        hyper = values[f"optimizer{i}/hyper"]
        group_names: list[list[str]] = [[] for _ in hyper]
        for key, group in values.items():
            if key.startswith(f"optimizer{i}/group/"):
                group_names[group].append(key[len(f"optimizer{i}/group/") :])
        named = NamedOptimizerState([{**h, "params": names} for h, names in zip(hyper, group_names)],
                                    _states_by_name(values, i))
        merged = merge_optimizer_states([named], order["parameter_order"])
        numbered = global_group_names([group_names], order["parameter_order"])  # the order `merged` numbers them
        index_of = {name: index for index, name in enumerate(name for names in numbered for name in names)}
        for name, entries in named.state.items():
            for entry, value in entries.items():
                if isinstance(value, Tensor):
                    place = ("optimizer_states", i, "state", index_of[name], entry)
                    places[f"optimizer{i}/state/{name}/{entry}"] = place
        optimizer_states.append(merged)
    lightning = values["lightning"]
    whole = {**lightning, "state_dict": state_dict, "optimizer_states": optimizer_states}
    if "optimizer_states" not in order["checkpoint"]:  # saved with weights_only=True
        del whole["optimizer_states"]
    return {key: whole[key] for key in order["checkpoint"] if key in whole}, places


# ---- reading -------------------------------------------------------------------------------------------------------


class _WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """torch's load planner, except that stored values are unpickled with the caller's ``weights_only`` (torch's
    own planner unpickles them with ``weights_only=False`` whatever the caller asked)."""

    def __init__(self, path: str | Path, weights_only: bool | None) -> None:
        super().__init__(flatten_state_dict=False)
        self.path, self.weights_only = path, weights_only
        self.refused: pickle.UnpicklingError | None = None

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        try:
            self.original_state_dict[key] = torch.load(value, weights_only=self.weights_only)
        except pickle.UnpicklingError as error:
            self.refused = pickle.UnpicklingError(
                f"entry {key!r} of the sharded checkpoint {str(self.path)!r} holds objects that loading with"
                " weights_only=True refuses (a checkpoint of this package holds tensors and plain values only)."
                " Load it with weights_only=False only if you trust its source."
                f" ({str(error).splitlines()[0]})"
            )
            raise self.refused from error


def read_entries(path: str | Path, tensors: dict[str, Tensor]) -> None:
    """Fill ``tensors`` in place (cast to their dtype) from the entries of those names of the sharded checkpoint
    ``path``; nothing else is read."""
    _read(committed_directory(path), tensors, weights_only=True)


def read_local(directory: str | Path, state_dict: dict[str, Any], weights_only: bool | None = True) -> None:
    """Fill ``state_dict`` from the files of ``directory`` in this process alone, whatever the other ranks do (no
    collective: each rank checks a checkpoint by itself)."""
    _read(directory, state_dict, weights_only, no_dist=True)


def _read(path: str | Path, state_dict: dict[str, Any], weights_only: bool | None, no_dist: bool = False) -> None:
    """Fill ``state_dict`` (tensors in place, other values replaced) from the ``torch.distributed.checkpoint``
    directory ``path``."""
    planner = _WeightsOnlyLoadPlanner(path, weights_only)
    try:
        dcp.load(state_dict, checkpoint_id=str(path), planner=planner, no_dist=no_dist)
    except CheckpointException:
        if planner.refused is not None:  # torch wraps it with every rank's traceback: raise it as it is
            raise planner.refused from None
        raise


def _states_by_name(flat: dict[str, Any], i: int) -> dict[str, dict[str, Any]]:
    by_name: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        parts = key.split("/")
        if parts[0] == f"optimizer{i}" and parts[1] == "state":
            by_name.setdefault(parts[2], {})[parts[3]] = value
    return by_name


def _empty(meta: Any, like: DTensor | None = None) -> Tensor | None:
    """A tensor to read a stored tensor into (sharded as ``like`` where it has the stored shape); ``None`` for a
    stored value."""
    if not isinstance(meta, TensorStorageMetadata):
        return None
    if like is not None and tuple(like.shape) == tuple(meta.size):
        return torch.empty_like(like, dtype=meta.properties.dtype)
    return torch.empty(meta.size, dtype=meta.properties.dtype)


def _at(container: Any, place: tuple[Any, ...]) -> Any:
    for step in place:
        container = container[step]
    return container


def _index(optimizer_key: str) -> int:
    return int(optimizer_key[len("optimizer") :])


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in group.items() if key != "params"}
