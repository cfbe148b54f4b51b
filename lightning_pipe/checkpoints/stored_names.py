"""Stored names placed on a model's keys as ``from_pretrained`` places them: your ``key_mapping``, the library
model's own renames, and its base-model prefix dropped or added.

A :class:`Placement` puts every stored name at one place of the LightningModule: under a module path (``"model."``),
after renames. Where a Hugging Face model sits (a module with a ``config`` and a ``base_model_prefix``), the library's
rules apply as ``from_pretrained`` applies them when it loads that model:

* the model class's conversion mapping (transformers' ``get_model_conversion_mapping``: names of older checkpoints,
  and the ``LayerNorm.gamma``/``beta`` of old BERT-style files), its renames only; a conversion that merges or
  splits tensors is not a rename, and a checkpoint that needs one is refused by the check that follows;
* the base-model prefix (``"model"`` for Llama, ``"bert"`` for BERT) dropped from a stored name, when a task model's
  checkpoint is read into its base model, or added, when a base model's checkpoint is read into a task model.

Before any of them, the user's ``key_mapping`` (``{regex: replacement}``, as ``from_pretrained(key_mapping=...)``)
renames each stored name: each pattern replaced at its first match, in order.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field

from torch import nn

BasePrefixChange = str  # "dropped", "added" or "" (none)


@dataclass(frozen=True)
class Placement:
    """Where each stored name lands: the model's key for each stored name that fills one."""

    prefix: str  # the module path (with its dot) under which the stored model sits
    keys: dict[str, str]  # stored name -> the LightningModule's key it fills
    library: str = ""  # the Hugging Face model class at the prefix, when its rules were applied
    base_model_prefix: str = ""
    base_prefix_change: BasePrefixChange = ""
    renamed: dict[str, str] = field(default_factory=dict)  # stored name -> its name after the renames, when changed

    @property
    def covered(self) -> str:
        """The keys the checkpoint must fill: those under it (a new task head beside a base checkpoint is not)."""
        return f"{self.prefix}{self.base_model_prefix}." if self.base_prefix_change == "added" else self.prefix

    def left_out(self, names: Iterable[str]) -> list[str]:
        """Stored names of a task model's own modules (its head), which a base model drops, as ``from_pretrained``
        does: those outside the base-model prefix when this placement drops it."""
        if self.base_prefix_change != "dropped":
            return []
        head = f"{self.base_model_prefix}."
        return [name for name in names if name not in self.keys and not self.renamed.get(name, name).startswith(head)]

    def describe(self) -> str:
        """``stored name NAME -> model key 'backbone.' + NAME less the base-model prefix 'model.' ...``: for the
        start-up line and messages."""
        text = f"stored name NAME -> model key {self.prefix!r} + NAME"
        if self.base_prefix_change == "dropped":
            text += f" less the base-model prefix '{self.base_model_prefix}.' (a task model's checkpoint in its base"
            text += f" model {self.library})"
        elif self.base_prefix_change == "added":
            text += f" with the base-model prefix '{self.base_model_prefix}.' added (a base model's checkpoint in the"
            text += f" task model {self.library})"
        if self.renamed:
            examples = ", ".join(f"{old!r} -> {new!r}" for old, new in list(self.renamed.items())[:2])
            text += f", {len(self.renamed)} renamed ({examples}{', ...' if len(self.renamed) > 2 else ''})"
        return text


def user_renames(key_mapping: Mapping[str, str] | None) -> Callable[[str], str]:
    """The stored name after the user's ``{regex: replacement}``: each pattern replaced at its first match, in
    order (transformers' ``key_mapping``)."""
    compiled = [(re.compile(pattern), replacement) for pattern, replacement in (key_mapping or {}).items()]

    def renamed(name: str) -> str:
        for pattern, replacement in compiled:
            name = pattern.sub(replacement, name, count=1)
        return name

    return renamed


def placements(
    model: nn.Module, keys: Collection[str], names: Iterable[str], key_mapping: Mapping[str, str] | None,
    prefix: str | None = None,
) -> list[Placement]:
    """Every placement of the stored ``names`` on ``model`` (whose state-dict keys are ``keys``) worth trying:
    under each module path (only ``prefix`` when given), as they are, and where a Hugging Face model sits, by its
    library's rules; outermost first, a module's plain placement before its library's."""
    user = user_renames(key_mapping)
    names = list(names)
    renamed = {name: user(name) for name in names}
    keys = set(keys)
    result = []
    for path, module in model.named_modules():
        here = f"{path}." if path else ""
        if prefix is not None and here != prefix:
            continue
        plain = {name: f"{here}{new}" for name, new in renamed.items() if f"{here}{new}" in keys}
        result.append(Placement(here, plain, renamed={k: v for k, v in renamed.items() if k != v}))
        if _is_library_model(module):
            result.append(_library_placement(module, here, keys, renamed))
    return result


def _is_library_model(module: nn.Module) -> bool:
    return hasattr(module, "config") and isinstance(getattr(module, "base_model_prefix", None), str)


def _library_placement(module: nn.Module, here: str, keys: set[str], renamed: Mapping[str, str]) -> Placement:
    """The stored names placed on the Hugging Face ``module`` at ``here`` as its ``from_pretrained`` places them."""
    own = {key[len(here):] for key in keys if key.startswith(here)}
    rename = _library_renames(module)
    base = module.base_model_prefix
    placed, changed, change = {}, {}, ""
    for name, new in renamed.items():
        candidate = rename(new)
        if candidate not in own and new in own:  # a name the renames should have left alone (as transformers)
            candidate = new
        if candidate != name:
            changed[name] = candidate
        if base and candidate.startswith(f"{base}.") and candidate[len(base) + 1:] in own:
            candidate, change = candidate[len(base) + 1:], change or "dropped"
        elif base and f"{base}.{candidate}" in own and candidate not in own:
            candidate, change = f"{base}.{candidate}", change or "added"
        if candidate in own:
            placed[name] = f"{here}{candidate}"
    return Placement(here, placed, type(module).__name__, base, change, changed)


def _library_renames(module: nn.Module) -> Callable[[str], str]:
    """The renames ``from_pretrained`` applies for ``module`` (its class's conversion mapping and the legacy
    ``gamma``/``beta``), through transformers' own functions; none where this transformers has no such mapping."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, apply_renamings
    except ImportError:  # an older transformers, or none
        return lambda name: name
    renamings = [entry for entry in get_model_conversion_mapping(module) if isinstance(entry, WeightRenaming)]
    return lambda name: apply_renamings(name, renamings)
