"""Pretrained weights for a model built on the meta device: which stored tensor fills which of the model's, checked
on the whole model before anything is read, then read for this rank's stage alone.

``GPipeStrategy(pretrained="path/to/model")`` names the weights (:class:`PretrainedWeights`; the formats are those of
:mod:`lightning_pipe.checkpoints.stored_weights`). At set-up, every rank:

1. maps the stored names onto the LightningModule's state-dict keys (:func:`map_stored_keys`): stored name ``k`` is
   the model's ``prefix + k``, the prefix given or inferred as the one under which most stored names are the
   model's (``"model."`` for ``self.model = GPT2LMHeadModel(config)``), after the renames and the base-model prefix
   ``from_pretrained`` applies where a Hugging Face model sits (:mod:`lightning_pipe.checkpoints.stored_names`). A
   key whose tensor is tied to another's (an output embedding sharing the input embedding's weight) is filled by
   that one, as the library ties them. The check covers the whole model, the same on every rank, so every rank
   fails alike, before the first step: keys of the model under the prefix that the checkpoint lacks, tensors of
   another shape, and stored names that fill nothing (less a task model's head, which its base model drops);
2. allocates its stage and the replicated modules (:func:`lightning_pipe.execution.materialize.materialize`, told which
   tensors are filled here, so that only the others are initialised: modules outside the prefix, such as a new
   head, and buffers no checkpoint holds, such as rotary frequencies);
3. reads exactly the stored tensors of what it holds (:func:`fill_from_stored`), in the Trainer precision's dtype
   or the stored one.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn

from lightning_pipe.checkpoints.stored_names import Placement, placements
from lightning_pipe.checkpoints.stored_weights import (
    StoredWeights,
    check_stored_weights_path,
    describe_names,
    open_stored_weights,
)

PretrainedDtype = Literal["precision", "checkpoint"]
PRETRAINED_DTYPES: tuple[str, ...] = get_args(PretrainedDtype)
# Set on a LightningModule once its pretrained weights are in: a later run of the same object (trainer.test after
# trainer.fit) keeps the weights it trained.
_LOADED = "_gpipe_pretrained_loaded"


@dataclass(frozen=True)
class PretrainedWeights:
    """Where the model's starting weights are stored, and how they map onto the LightningModule.

    Args:
        path: a Hugging Face model directory (``model.safetensors``, sharded with ``model.safetensors.index.json``,
            or ``pytorch_model.bin``), a ``.safetensors`` or ``torch.save``d state-dict file, or a checkpoint of
            this package (a consolidated file or a sharded directory).
        prefix: where the stored model sits in the LightningModule: stored name ``k`` fills the LightningModule's
            ``prefix + k`` (``"model."`` for ``self.model = GPT2LMHeadModel(config)``; ``""`` for a checkpoint of
            the LightningModule itself). ``None``: the prefix under which most stored names are keys of the model.
            Keys outside the prefix (your own head) start as they would without pretrained weights.
        dtype: ``"precision"``: every floating-point tensor takes the Trainer's precision's dtype (float32 for
            ``"32-true"`` and the mixed precisions, bfloat16 for ``"bf16-true"``), whatever the model was built in;
            ``"checkpoint"``: every tensor takes its stored dtype (bf16 weights stay bf16 under any precision that
            keeps them, as ``from_pretrained(dtype="auto")``).
        key_mapping: ``{regex: replacement}`` renaming stored names before they are placed, as
            ``from_pretrained(key_mapping=...)``: each pattern replaced at its first match, in order
            (``{r"^transformer\.blocks\.": "transformer.h."}``).
    """

    path: Path
    prefix: str | None = None
    dtype: PretrainedDtype = "precision"
    key_mapping: Mapping[str, str] | None = None


def checked_pretrained(value: Any, key: str = "") -> PretrainedWeights | None:
    """``value`` (a path, a mapping with ``path``, ``prefix`` and ``dtype``, or :class:`PretrainedWeights`) as
    :class:`PretrainedWeights`, after checking that the path holds weights this package reads; ``None`` stays
    ``None``. ``key`` prefixes the setting's name in messages (``"strategy."`` under Hydra)."""
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)):
        value = PretrainedWeights(Path(value))
    elif isinstance(value, Mapping):
        unknown = sorted(set(value) - {"path", "prefix", "dtype", "key_mapping"})
        if unknown or "path" not in value:
            raise ValueError(
                f"{key}pretrained={dict(value)!r} is invalid; give a path, or a mapping with 'path' and optionally"
                " 'prefix' (where the stored model sits in the LightningModule, e.g. 'model.'), 'dtype'"
                f" ({' or '.join(map(repr, PRETRAINED_DTYPES))}) and 'key_mapping' ({{regex: replacement}})."
            )
        value = PretrainedWeights(
            Path(value["path"]), value.get("prefix"), value.get("dtype", "precision"), value.get("key_mapping")
        )
    elif not isinstance(value, PretrainedWeights):
        raise ValueError(
            f"{key}pretrained={value!r} is invalid; give the path of a model directory or weights file, or"
            " lightning_pipe.PretrainedWeights(path, prefix=..., dtype=...)."
        )
    if value.prefix is not None and (not isinstance(value.prefix, str) or value.prefix.startswith(".")):
        raise ValueError(
            f"{key}pretrained.prefix={value.prefix!r} is invalid; give the LightningModule attribute path that"
            " precedes the stored names, with its dot ('model.'), '' for none, or None to infer it."
        )
    if value.dtype not in PRETRAINED_DTYPES:
        raise ValueError(
            f"{key}pretrained.dtype={value.dtype!r} is invalid; use 'precision' (the Trainer precision's dtype) or"
            " 'checkpoint' (the stored dtype)."
        )
    _check_key_mapping(value.key_mapping, key)
    try:
        check_stored_weights_path(value.path)
    except ValueError as error:
        raise ValueError(f"{key}pretrained: {error}") from None
    prefix = value.prefix
    if prefix and not prefix.endswith("."):  # "model" means the module `model`: its keys start with "model."
        prefix = f"{prefix}."
    key_mapping = dict(value.key_mapping) if value.key_mapping is not None else None
    return PretrainedWeights(Path(value.path), prefix, value.dtype, key_mapping)


def _check_key_mapping(key_mapping: Any, key: str) -> None:
    if key_mapping is None:
        return
    if not isinstance(key_mapping, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in key_mapping.items()
    ):
        raise ValueError(
            f"{key}pretrained.key_mapping={key_mapping!r} is invalid; give {{regex: replacement}} strings, as"
            " from_pretrained(key_mapping=...): {'^transformer\\.blocks\\.': 'transformer.h.'}."
        )
    for pattern in key_mapping:
        try:
            re.compile(pattern)
        except re.error as error:
            raise ValueError(
                f"{key}pretrained.key_mapping: {pattern!r} is not a regular expression ({error}); escape its dots"
                " and brackets (re.escape) or fix the pattern."
            ) from None


class PretrainedMismatchError(ValueError):
    """The stored weights do not fit the model (raised on every rank, before the first step)."""


@dataclass(frozen=True)
class KeyMapping:
    """Which stored tensor fills each state-dict key of the model, and how the mapping was found."""

    placement: Placement
    inferred: bool
    sources: dict[str, str]  # the model's state-dict key -> the stored name that fills it
    filled: frozenset[str] = field(default_factory=frozenset)  # every key whose tensor is filled (ties included)
    left_out: tuple[str, ...] = ()  # stored names of a task model's head, which its base model drops

    @property
    def prefix(self) -> str:
        """Where the stored model sits in the LightningModule (the export writes the keys under it)."""
        return self.placement.prefix

    def describe(self, stored: StoredWeights) -> str:
        matched = len(set(self.sources.values()))
        how = (
            f"inferred: under it {matched} of the {len(stored.entries)} stored names are the model's"
            if self.inferred else "as given"
        )
        text = f"{self.placement.describe()} (prefix {self.prefix!r}, {how})"
        if self.left_out:
            text += f"; not read, as from_pretrained drops a task model's head: {describe_names(self.left_out)}"
        return text


def map_stored_keys(
    model: nn.Module, stored: StoredWeights, prefix: str | None, key_mapping: Mapping[str, str] | None = None
) -> KeyMapping:
    """The mapping of ``stored`` onto ``model``'s state dict (the whole model: call it before the split); a
    :class:`PretrainedMismatchError` naming every problem and the mapping tried when they do not fit."""
    tensors = model.state_dict(keep_vars=True)
    inferred = prefix is None
    placement = _chosen_placement(model, tensors, stored, prefix, key_mapping)
    tied: dict[int, list[str]] = {}
    for key, tensor in tensors.items():
        tied.setdefault(id(tensor), []).append(key)
    landed: dict[str, str] = {}  # the model's key -> the stored name placed on it
    for name, key in placement.keys.items():
        landed.setdefault(key, name)
    covered = placement.covered
    sources: dict[str, str] = {}
    missing = []
    for key, tensor in tensors.items():
        if not key.startswith(covered):
            continue  # outside the stored model: the user's own modules, or a new head beside a base checkpoint
        candidates = [key, *(other for other in tied[id(tensor)] if other != key and other.startswith(covered))]
        source = next((landed[c] for c in candidates if c in landed), None)
        if source is None:
            missing.append(key)
        else:
            sources[key] = source
    filled = frozenset(other for key in sources for other in tied[id(tensors[key])])
    left_out = tuple(placement.left_out(stored.entries))
    mapping = KeyMapping(placement, inferred, sources, filled, left_out)
    used = set(sources.values()) | set(left_out)
    ignored = _ignored_stored_names(model, placement.prefix)
    unused = [name for name in stored.entries if name not in used and not (ignored and ignored.search(name))]
    reshaped = [
        f"{key!r} (model {list(tensors[key].shape)}, stored {list(stored.entries[name].shape)})"
        for key, name in sources.items() if tuple(tensors[key].shape) != stored.entries[name].shape
    ]
    problems = []
    if missing:
        problems.append(f"keys of the model that the checkpoint lacks: {describe_names(missing)}")
    if reshaped:
        problems.append(f"tensors stored with another shape: {describe_names(reshaped, quoted=False)}")
    if unused:
        problems.append(f"stored names that fill no key of the model: {describe_names(unused)}")
    if problems:
        raise PretrainedMismatchError(
            f"the pretrained weights {stored.describe()} do not fit the model: {'; '.join(problems)}. Mapping tried:"
            f" {mapping.describe(stored)}. Build the model from the checkpoint's own config (its config.json), or"
            " give PretrainedWeights(path, prefix=...) where the stored model sits in your LightningModule, and"
            " key_mapping={regex: replacement} for names stored otherwise."
        )
    return mapping


def _chosen_placement(
    model: nn.Module, tensors: Mapping[str, Tensor], stored: StoredWeights, prefix: str | None,
    key_mapping: Mapping[str, str] | None,
) -> Placement:
    """The placement under which most stored names are state-dict keys of ``model`` (under ``prefix`` when given):
    several that place the names alike are one, the outermost; several that place them differently are an error."""
    options = placements(model, tensors, stored.entries, key_mapping, prefix)
    if prefix is not None and not options:  # no module there: every key under it is reported missing
        return Placement(prefix, {})
    best = max(len(option.keys) for option in options)
    winners: list[Placement] = []
    for option in options:
        if len(option.keys) == best and all(option.keys != winner.keys for winner in winners):
            winners.append(option)
    if best == 0 and prefix is None:
        tried = sorted({option.prefix for option in options}, key=len)
        raise PretrainedMismatchError(
            f"the pretrained weights {stored.describe()} do not fit the model: no prefix makes a stored name a key of"
            f" the model. Stored names: {describe_names(list(stored.entries))}; the model's keys:"
            f" {describe_names(list(tensors))}; prefixes tried (stored name NAME -> model key PREFIX + NAME, with"
            f" from_pretrained's renames where a Hugging Face model sits): {describe_names(tried)}. Build the model"
            " whose weights these are, or give PretrainedWeights(path, prefix=..., key_mapping=...)."
        )
    if len(winners) > 1:
        raise PretrainedMismatchError(
            f"the pretrained weights {stored.describe()} fit the model under several prefixes equally well"
            f" ({best} stored names each): {describe_names([winner.prefix for winner in winners])}; give"
            " PretrainedWeights(path, prefix=...) naming where the stored model sits."
        )
    return winners[0]


def _ignored_stored_names(model: nn.Module, prefix: str) -> re.Pattern[str] | None:
    """Stored names the model's library says to ignore (Hugging Face's ``_keys_to_ignore_on_load_unexpected`` of
    every model under the prefix: buffers older versions saved, such as GPT-2's ``attn.bias``)."""
    patterns: set[str] = set()
    for name, module in model.named_modules():
        if f"{name}.".startswith(prefix) or prefix.startswith(f"{name}."):
            patterns.update(getattr(module, "_keys_to_ignore_on_load_unexpected", None) or ())
    return re.compile("|".join(f"({pattern})" for pattern in sorted(patterns))) if patterns else None


@dataclass(frozen=True)
class PretrainedLoad:
    """Pretrained weights checked against a model: what to read, once this rank's share is allocated."""

    weights: PretrainedWeights
    stored: StoredWeights
    mapping: KeyMapping

    @classmethod
    def plan(cls, model: nn.Module, weights: PretrainedWeights) -> PretrainedLoad:
        """Open the stored weights' index and map them onto ``model`` (whole, before the split); raises
        :class:`PretrainedMismatchError` when they do not fit."""
        stored = open_stored_weights(weights.path)
        return cls(weights, stored, map_stored_keys(model, stored, weights.prefix, weights.key_mapping))

    def fill(self, module: nn.Module, precision_dtype: torch.dtype) -> list[str]:
        """Read this rank's share into ``module`` (see :func:`fill_from_stored`) and mark it loaded;
        ``precision_dtype`` is the floating-point dtype of the Trainer's precision."""
        dtype = precision_dtype if self.weights.dtype == "precision" else None
        read = fill_from_stored(module, self.stored, self.mapping, dtype)
        setattr(module, _LOADED, True)
        return read


def fill_from_stored(
    module: nn.Module, stored: StoredWeights, mapping: KeyMapping, floating_dtype: torch.dtype | None
) -> list[str]:
    """Copy the stored tensors into ``module``'s state-dict tensors that ``mapping`` fills and this rank holds (its
    stage and the replicated modules, allocated), each tied tensor once; returns the stored names read.

    Each floating-point tensor first takes ``floating_dtype``, or its stored dtype when that is ``None``; the others
    keep the model's dtype."""
    targets: dict[str, list[Tensor]] = {}
    seen: set[int] = set()
    for key, tensor in module.state_dict(keep_vars=True).items():
        source = mapping.sources.get(key)
        if source is None or id(tensor) in seen or tensor.is_meta:
            continue
        seen.add(id(tensor))
        dtype = floating_dtype or stored.entries[source].dtype
        if tensor.is_floating_point() and tensor.dtype != dtype:
            tensor.data = torch.empty_like(tensor, dtype=dtype)
        targets.setdefault(source, []).append(tensor.detach())
    with torch.no_grad():
        stored.read_into(targets)
    return list(targets)


def holds_pretrained_weights(module: nn.Module) -> bool:
    """Whether an earlier run loaded pretrained weights into ``module`` (which it may have trained since)."""
    return bool(getattr(module, _LOADED, False))
