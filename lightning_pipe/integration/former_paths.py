"""Module paths documented before the package had folders, kept importable: ``lightning_pipe.hydra`` is
``lightning_pipe.integration.hydra_schema`` now, and code written against the old path still runs.

Each former path is served on first import by the module at its new place (the same module object, under both
names), with a ``DeprecationWarning`` that names the new path. Nothing is imported until someone asks.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

# The former paths that docs/api.md, docs/schedules.md and examples/train.py once showed, and where each went.
FORMER_PATHS = {
    "lightning_pipe.hydra": "lightning_pipe.integration.hydra_schema",
    "lightning_pipe.schedule": "lightning_pipe.schedules",
    "lightning_pipe.engine": "lightning_pipe.execution.engine",
    "lightning_pipe.stall_rule": "lightning_pipe.reliability.stall_rule",
    "lightning_pipe.pretrained": "lightning_pipe.checkpoints.pretrained",
}


class FormerPathFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds a former path and loads it as the module at its new place."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.util.spec_from_loader(name, self) if name in FORMER_PATHS else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        new = FORMER_PATHS[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; import it from there.", DeprecationWarning, stacklevel=2)
        return importlib.import_module(new)

    def exec_module(self, module: ModuleType) -> None:
        """The module at the new place has run already."""


def install() -> None:
    if not any(isinstance(finder, FormerPathFinder) for finder in sys.meta_path):
        sys.meta_path.append(FormerPathFinder())
