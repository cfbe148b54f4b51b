"""The trained model written out in its library's format: a Hugging Face directory of safetensors shards, their
index and the model's config, written a shard at a time: a process holds no more than the shard it writes.

Two writers share it: :meth:`lightning_pipe.GPipeStrategy.save_pretrained` after (or during) a run, where every
stage writes its own shard at once and global rank 0 the index and config; and the command
``lightning-pipe export_pretrained`` over a consolidated or sharded checkpoint (:func:`export_checkpoint`).
``AutoModelForCausalLM.from_pretrained(directory)`` (or the model class's) then loads the directory.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import Tensor, nn

from lightning_pipe.checkpoints.stored_weights import SAFETENSORS_INDEX, StoredWeights, describe_names, read_tensors
from lightning_pipe.checkpoints.whole_model import WholeModelLayout, gather_to_loss_stage

CONFIG_FILES = ("config.json", "generation_config.json")  # what `from_pretrained` reads besides the weights
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]?)i?B?\s*$", re.IGNORECASE)


def shard_name(index: int, count: int) -> str:
    """Hugging Face's name of shard ``index`` (from 0) of ``count``: ``model-00001-of-00004.safetensors``."""
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def exported_tensors(
    state: Mapping[str, Tensor], keys: Iterable[str], prefix: str, dtype: torch.dtype | None
) -> dict[str, Tensor]:
    """The tensors of ``keys`` under the names the library gives them (``prefix`` removed), on the CPU, contiguous,
    cast to ``dtype`` if given; a tensor tied to an earlier key (an output embedding sharing the input embedding's
    weight) is written once, under its first name, as the library's own ``save_pretrained`` writes it."""
    tensors: dict[str, Tensor] = {}
    seen: set[int] = set()
    for key in keys:
        tensor = state[key]
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        value = tensor.detach().to("cpu", dtype=dtype or tensor.dtype)
        tensors[key[len(prefix):]] = value.contiguous()
    return tensors


def write_shard(directory: Path, name: str, tensors: Mapping[str, Tensor]) -> dict[str, int]:
    """Write one safetensors shard (atomically: under a temporary name first); its tensors' sizes in bytes."""
    directory.mkdir(parents=True, exist_ok=True)
    partial = directory / f"{name}.partial"
    save_file(dict(tensors), str(partial), metadata={"format": "pt"})
    os.replace(partial, directory / name)
    return {key: tensor.numel() * tensor.element_size() for key, tensor in tensors.items()}


def write_index(directory: Path, shards: Mapping[str, Mapping[str, int]]) -> None:
    """The index that maps every tensor to its shard (``model.safetensors.index.json``), from each shard's sizes."""
    weight_map = {key: name for name, sizes in sorted(shards.items()) for key in sizes}
    total = sum(size for sizes in shards.values() for size in sizes.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")


def write_model_config(model: nn.Module, directory: Path, dtype: torch.dtype | None = None) -> None:
    """Write the config of ``model`` when it is a Hugging Face model (``model.config.save_pretrained``, and its
    generation config), saying ``dtype`` when the weights were cast (``from_pretrained(dtype="auto")`` reads it)."""
    config = getattr(model, "config", None)
    if not callable(getattr(config, "save_pretrained", None)):
        return
    if dtype is not None:
        config = copy.deepcopy(config)
        config.dtype = dtype
    config.save_pretrained(str(directory))
    generation = getattr(model, "generation_config", None)
    if callable(getattr(generation, "save_pretrained", None)):
        generation.save_pretrained(str(directory))


def library_model_prefix(module: nn.Module) -> str:
    """Where the one outermost Hugging Face model (a module with a ``config`` and ``save_pretrained``) sits in
    ``module`` (``"model."``); ``""`` when there is none or several."""
    found = [
        name for name, sub in module.named_modules()
        if name and callable(getattr(sub, "save_pretrained", None)) and hasattr(sub, "config")
    ]
    outermost = [name for name in found if not any(name.startswith(f"{other}.") for other in found)]
    return f"{outermost[0]}." if len(outermost) == 1 else ""


def parse_size(size: str | int) -> int:
    """Bytes from ``"5GB"``, ``"500MB"``, ``"64KiB"`` or an integer (powers of 1024, as Hugging Face counts)."""
    if isinstance(size, int):
        return size
    match = _SIZE.match(size)
    if match is None:
        raise ValueError(f"max shard size {size!r} is invalid; give a size such as '5GB', '500MB' or a byte count.")
    return int(float(match[1]) * 1024 ** " KMG".index((match[2] or " ").upper()))


def export_pretrained_by_stage(
    module: nn.Module,
    pipelined: WholeModelLayout,
    directory: Path,
    prefix: str,
    dtype: torch.dtype | str | None,
    stage: int,
    stage_ranks: Sequence[int],
    rank: int,
    group: dist.ProcessGroup | None,
    writes: bool,
    max_shard_bytes: int | None = None,
) -> str:
    """Every stage of this rank's pipeline writes its share of ``module`` (when ``writes``: the first data-parallel
    replica), then the loss stage (global rank 0 in the first replica) the index and the model's config, from the
    shards' names and sizes alone. Each key is written once, by :meth:`WholeModelLayout.writer`'s stage (a tied
    tensor under its first name); a stage's share is one shard, or shards of at most ``max_shard_bytes``, numbered
    across the stages in stage order. Returns the keys left out (outside ``prefix``), described for a message, or
    ``""``."""
    cast = export_dtype(dtype)
    state = module.state_dict(keep_vars=True)
    keys = [key for key in pipelined.stage_keys(stage) if key.startswith(prefix)] if writes else []
    sizes = {key: state[key].numel() * (cast or state[key].dtype).itemsize for key in keys}
    chunks = _cut(keys, sizes, max_shard_bytes) if max_shard_bytes is not None else [keys] if keys else []
    counts: list[Any] = [None] * len(stage_ranks)
    dist.all_gather_object(counts, (stage, len(chunks)), group=group)  # shards are numbered across the stages
    by_stage = dict(counts)
    first, total = sum(by_stage[s] for s in range(stage)), sum(by_stage.values())
    written = {}
    for index, chunk in enumerate(chunks):
        name = shard_name(first + index, total)
        written[name] = write_shard(directory, name, exported_tensors(state, chunk, prefix, cast))
    shards = gather_to_loss_stage(written, stage_ranks, rank, group)
    if shards is not None and writes:
        write_index(directory, {name: sizes for shard in shards for name, sizes in shard.items()})
        write_model_config(module.get_submodule(prefix[:-1]) if prefix else module, directory, cast)
    left_out = [key for key in pipelined.state_keys if not key.startswith(prefix)]
    return describe_names(left_out) if left_out else ""


def export_checkpoint(
    stored: StoredWeights,
    out: Path,
    prefix: str | None = None,
    config: Path | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = 5 * 2**30,
) -> list[str]:
    """Write the model of the checkpoint ``stored`` as a Hugging Face directory ``out``, a shard at a time; returns
    the keys left out (outside ``prefix``).

    ``prefix`` (``"model."``): what the LightningModule puts before the library's names; ``None``: the first
    component that every stored key shares, else none. Each stored file (a sharded checkpoint's file per rank) is
    cut into shards of at most ``max_shard_bytes``. ``config``: a directory (or config file) whose
    ``config.json`` and ``generation_config.json`` are copied, such as the pretrained model's.
    """
    names = list(stored.entries)
    if prefix is None:
        prefix = _shared_first_component(names)
    kept = [name for name in names if name.startswith(prefix)]
    if not kept:
        raise ValueError(
            f"no stored key of {stored.describe()} starts with the prefix {prefix!r}: its keys are"
            f" {describe_names(names)}; give --prefix as it appears in them (e.g. 'model.')."
        )
    wanted = set(kept)
    shards = [
        chunk
        for file_names in stored.files()
        for chunk in _chunks([n for n in file_names if n in wanted], stored, dtype, max_shard_bytes)
    ]
    out.mkdir(parents=True, exist_ok=True)
    written = {}
    for index, chunk in enumerate(shards):
        tensors = read_tensors(stored, chunk)  # one shard in memory at a time
        name = shard_name(index, len(shards))
        written[name] = write_shard(out, name, exported_tensors(tensors, chunk, prefix, dtype))
        del tensors
    write_index(out, written)
    if config is not None:
        copy_config(config, out, dtype)
    return [name for name in names if name not in wanted]


def copy_config(source: Path, out: Path, dtype: torch.dtype | None = None) -> None:
    """Copy ``config.json`` and ``generation_config.json`` from ``source`` (a directory, or a config file itself);
    the copied config says ``dtype`` when the weights were cast."""
    if source.is_file():
        shutil.copyfile(source, out / "config.json")
    else:
        copied = [name for name in CONFIG_FILES if (source / name).is_file()]
        if "config.json" not in copied:
            raise ValueError(
                f"{str(source)!r} holds no config.json; give the pretrained model's directory or its config."
            )
        for name in copied:
            shutil.copyfile(source / name, out / name)
    if dtype is not None:
        config = json.loads((out / "config.json").read_text())
        config["dtype"] = str(dtype).removeprefix("torch.")
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _shared_first_component(names: list[str]) -> str:
    """``"model."`` when every name starts with it (a LightningModule holding one model), else ``""``."""
    firsts = {name.split(".", 1)[0] for name in names if "." in name}
    if len(firsts) == 1 and all("." in name for name in names):
        return f"{firsts.pop()}."
    return ""


def _chunks(names: list[str], stored: StoredWeights, dtype: torch.dtype | None, limit: int) -> list[list[str]]:
    """``names`` in order, cut into runs of at most ``limit`` bytes (a tensor larger than that alone)."""
    sizes = {name: math.prod(stored.entries[name].shape) * (dtype or stored.entries[name].dtype).itemsize
             for name in names}
    return _cut(names, sizes, limit)


def _cut(names: list[str], sizes: Mapping[str, int], limit: int) -> list[list[str]]:
    """``names`` in order, cut into runs of at most ``limit`` bytes by ``sizes`` (a tensor larger than that alone),
    as ``save_pretrained(max_shard_size=...)`` cuts them."""
    chunks: list[list[str]] = []
    size = 0
    for name in names:
        if not chunks or (size + sizes[name] > limit and chunks[-1]):
            chunks.append([])
            size = 0
        chunks[-1].append(name)
        size += sizes[name]
    return chunks


def export_dtype(value: Any) -> torch.dtype | None:
    """``torch.bfloat16`` from ``"bfloat16"`` (or a dtype, or None)."""
    if value is None or isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype={value!r} is not a torch dtype; use e.g. 'bfloat16', 'float16' or 'float32'.")
    return dtype
