"""Which module of a model to pipeline, and putting a stand-in in its place.

Which of its layers each stage gets is :mod:`lightning_pipe.balance`'s job.
"""

from __future__ import annotations

from torch import nn


def find_pipelined_module(model: nn.Module, module_name: str | None = None) -> tuple[str, nn.Sequential]:
    """Return the dotted name and the ``nn.Sequential`` to pipeline.

    With ``module_name`` (a dotted attribute path such as ``"net.model"``), that module. Without it, among the
    ``nn.Sequential`` modules not nested in another ``nn.Sequential``, the one with the most parameters.
    """
    if module_name is not None:
        module = _get_submodule(model, module_name)
        if not isinstance(module, nn.Sequential):
            raise TypeError(
                f"module_name={module_name!r} names a {type(module).__name__}, not an nn.Sequential; point"
                " module_name at the nn.Sequential whose layers should be split into stages."
            )
        return module_name, module

    candidates = _outermost_sequentials(model)
    if not candidates:
        raise ValueError(
            f"{type(model).__name__} contains no nn.Sequential to pipeline; hold the layers to split in an"
            " nn.Sequential (e.g. `self.layers = nn.Sequential(*blocks)`) and call it in your step, or pass"
            " module_name='path.to.sequential'."
        )
    return max(candidates, key=lambda item: _num_parameters(item[1]))


def replace_submodule(module: nn.Module, name: str, replacement: nn.Module) -> None:
    """Put ``replacement`` where ``module``'s submodule called ``name`` (a dotted path) is."""
    parent_name, _, attribute = name.rpartition(".")
    setattr(module.get_submodule(parent_name) if parent_name else module, attribute, replacement)


def _get_submodule(model: nn.Module, module_name: str) -> nn.Module:
    try:
        return model.get_submodule(module_name)
    except AttributeError:
        available = [name for name, module in model.named_modules() if isinstance(module, nn.Sequential)]
        raise ValueError(
            f"module_name={module_name!r} does not exist in {type(model).__name__}; the nn.Sequential modules it"
            f" holds are {available or 'none'}."
        ) from None


def _outermost_sequentials(model: nn.Module) -> list[tuple[str, nn.Sequential]]:
    found: list[tuple[str, nn.Sequential]] = []

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(child, nn.Sequential):
                found.append((path, child))
            else:
                visit(child, path)

    visit(model, "")
    return found


def _num_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
