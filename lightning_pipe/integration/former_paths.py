"""Module paths documented before the package had folders, kept importable: ``lightning_pipe.hydra`` is
``lightning_pipe.integration.hydra_schema`` now, and code written against the old path still runs.

Each former path is served on first import by the module at its new place (the same module object, under both
names), with a ``DeprecationWarning`` that names the new path. Nothing is imported until someone asks. A former
command (``python -m lightning_pipe.plan``) runs the module at its new place as ``__main__``, as before.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import CodeType, ModuleType

# The former paths that docs/api.md, docs/schedules.md and examples/train.py once showed, and where each went.
FORMER_PATHS = {
    "lightning_pipe.hydra": "lightning_pipe.integration.hydra_schema",
    "lightning_pipe.schedule": "lightning_pipe.schedules",
    "lightning_pipe.engine": "lightning_pipe.execution.engine",
    "lightning_pipe.stall_rule": "lightning_pipe.reliability.stall_rule",
    "lightning_pipe.pretrained": "lightning_pipe.checkpoints.pretrained",
    "lightning_pipe.config": "lightning_pipe.partition.counts",
    "lightning_pipe.emulate": "lightning_pipe.testing.emulate",
    # The commands, now subcommands of the `lightning-pipe` console script (lightning_pipe.commands).
    "lightning_pipe.plan": "lightning_pipe.commands.plan",
    "lightning_pipe.export_pretrained": "lightning_pipe.commands.export_pretrained",
    "lightning_pipe.consolidate_checkpoint": "lightning_pipe.commands.consolidate_checkpoint",
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

    def get_code(self, name: str) -> CodeType | None:
        """The code of the module at the new place: what ``python -m FORMER.PATH`` runs as ``__main__``."""
        spec = importlib.util.find_spec(FORMER_PATHS[name])
        return spec.loader.get_code(spec.name) if spec is not None and spec.loader is not None else None  # type: ignore[attr-defined]


def install() -> None:
    if not any(isinstance(finder, FormerPathFinder) for finder in sys.meta_path):
        # First: a former path is never a module of this tree, though an editable install of another checkout
        # (whose finder comes before the path's) may still hold a file there.
        sys.meta_path.insert(0, FormerPathFinder())
