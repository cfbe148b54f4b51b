"""Module hooks kept away from the runs on the meta device.

A stage learns the shape of a block it does not run by running it on the meta device
(:mod:`lightning_pipe.execution.stage`), and the region is found by observing a forward there
(:mod:`lightning_pipe.partition.region`): tensors without values, which a user's hook (one that reads activations,
counts calls, records shapes) must never see. Inside :func:`hooks_set_aside` none of the modules' forward and backward
hooks registered before fires, nor any global module hook; hooks registered inside (by the caller, to observe the run)
do. torch's own hooks that compute a module's weights before its forward (pruning, ``weight_norm``, ``spectral_norm``)
stay: the module needs them to run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch.nn.modules.module as torch_module
from torch import nn
from torch.nn.utils.prune import BasePruningMethod
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

_MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_GLOBAL_HOOKS = (
    "_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks", "_global_backward_hooks"
)
_WEIGHT_HOOKS = (BasePruningMethod, WeightNorm, SpectralNorm)

# The hook dictionaries set aside now (by id), so that a nested call leaves the caller's observers in place.
_set_aside: set[int] = set()


@contextlib.contextmanager
def hooks_set_aside(modules: Iterable[nn.Module]) -> Iterator[None]:
    """While open, the hooks of ``modules`` and the global module hooks registered before do not fire."""
    dictionaries = [getattr(module, name) for module in modules for name in _MODULE_HOOKS]
    dictionaries += [getattr(torch_module, name) for name in _GLOBAL_HOOKS]
    saved: list[tuple[dict[int, Any], dict[int, Any]]] = []
    for hooks in dictionaries:
        if id(hooks) in _set_aside:
            continue
        kept = {key: hook for key, hook in hooks.items() if isinstance(hook, _WEIGHT_HOOKS)}
        saved.append((hooks, dict(hooks)))
        _set_aside.add(id(hooks))
        hooks.clear()
        hooks.update(kept)
    try:
        yield
    finally:
        for hooks, original in saved:
            added = {key: hook for key, hook in hooks.items() if key not in original}
            hooks.clear()
            hooks.update(original)
            hooks.update(added)
            _set_aside.discard(id(hooks))
