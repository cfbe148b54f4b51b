"""Sharded checkpoints through ``torch.distributed.checkpoint``: each rank writes and reads only its own stage.

For models too large to gather on one host (``GPipeStrategy(save_distributed_checkpoint=True)``). Keys are named
after the whole model, never after a rank, so a checkpoint saved with any stage count loads with any other:

* ``model/<state-dict key>``: weights (a parameter held by every stage is written once);
* ``optimizer<i>/state/<parameter name>/<entry>``: the optimizer state of each parameter (momentum, ``step``...);
* ``optimizer<i>/hyper``: the parameter groups' hyper-parameters, the same on every stage;
* ``lightning``: everything else Lightning saves (loops, callbacks, schedulers, hyper-parameters).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor

from lightning_pipe.consolidate import NamedOptimizerState

SHARDED = "gpipe_sharded"  # marks a checkpoint dict that holds only this rank's share


def is_sharded_checkpoint(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / ".metadata").is_file()


def save(checkpoint: dict[str, Any], path: str | Path) -> None:
    """Write this rank's share; ``checkpoint["optimizer_states"]`` holds :class:`NamedOptimizerState` objects."""
    flat: dict[str, Any] = {f"model/{key}": value for key, value in checkpoint["state_dict"].items()}
    for i, named in enumerate(checkpoint.get("optimizer_states", [])):
        for name, entries in named.state.items():
            for entry, value in entries.items():
                flat[f"optimizer{i}/state/{name}/{entry}"] = value if isinstance(value, Tensor) else _packed(value)
        flat[f"optimizer{i}/hyper"] = _packed([_hyper(group) for group in named.groups])
    flat["lightning"] = _packed({k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")})
    dcp.save(flat, checkpoint_id=str(path))


def load(path: str | Path, state_keys: set[str], optimizer_names: list[list[list[str]]]) -> dict[str, Any]:
    """This rank's share: weights for ``state_keys`` and, per optimizer, the state of its parameter groups'
    names (``optimizer_names[i]``), numbered as the local optimizer numbers them. Nothing else is read."""
    metadata = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    local_names = [{name for group in groups for name in group} for groups in optimizer_names]
    wanted: dict[str, Any] = {}
    for key, meta in metadata.items():
        parts = key.split("/")
        if (
            (parts[0] == "model" and key[len("model/") :] in state_keys)
            or key == "lightning"
            or (parts[0].startswith("optimizer") and parts[1] == "hyper")
            or (parts[0].startswith("optimizer") and parts[1] == "state" and parts[2] in local_names[_index(parts[0])])
        ):
            wanted[key] = torch.empty(meta.size, dtype=meta.properties.dtype) if hasattr(meta, "size") else None
    dcp.load(wanted, checkpoint_id=str(path))
    wanted = {key: _unpacked(value) for key, value in wanted.items()}
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
    by_name: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        parts = key.split("/")
        if parts[0] == f"optimizer{i}" and parts[1] == "state":
            by_name.setdefault(parts[2], {})[parts[3]] = value
    state: dict[int, dict[str, Any]] = {}
    param_groups, index = [], 0
    for names, group in zip(groups, hyper):
        param_groups.append({**group, "params": list(range(index, index + len(names)))})
        for name in names:
            if name in by_name:
                state[index] = by_name[name]
            index += 1
    return {"state": state, "param_groups": param_groups}


def _index(optimizer_key: str) -> int:
    return int(optimizer_key[len("optimizer") :])


def _hyper(group: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in group.items() if key != "params"}


def _unpacked(value: Any) -> Any:
    if not isinstance(value, io.BytesIO):
        return value
    value.seek(0)
    return torch.load(value, weights_only=False)  # written by this module's `save`, from this job's own objects


def _packed(value: Any) -> io.BytesIO:
    """A value stored as one opaque item (``torch.distributed.checkpoint`` would otherwise walk into dicts)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return buffer
