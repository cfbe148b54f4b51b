"""Which blocks of a model to pipeline: a container's children, or a chain of sibling modules.

A region is the ordered list of blocks that the model's own code calls one after another, each call's first
argument being the previous call's output: the children of an ``nn.Sequential`` (called whole, or iterated) or
an ``nn.ModuleList`` (iterated by the model's loop, as Hugging Face models and ``nn.TransformerEncoder`` do), or
consecutive children of one module called in its ``forward`` (``conv1, bn1, relu, maxpool, layer1..layer4,
avgpool`` in a ResNet). The region is replaced at set-up by this rank's blocks and stand-ins for the others
(:mod:`lightning_pipe.stage`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

Container = (nn.Sequential, nn.ModuleList)
# NOTE: two chained modules are most often a body and its head (`head(net(x))`): pipelined as two blocks, the body
# would be one stage whole, where its own nn.Sequential splits evenly. A chain counts from three modules on; a
# shorter one can still be named with module_name=[...].
MIN_CHAIN = 3


@dataclass(frozen=True)
class Region:
    """The blocks to split into stages, in the order the model calls them."""

    names: tuple[str, ...]  # dotted paths of the blocks in the LightningModule
    container: str | None  # the nn.Sequential / nn.ModuleList holding them, or None for a chain of siblings

    def __len__(self) -> int:
        return len(self.names)

    @property
    def label(self) -> str:
        """How the summary and errors name the region: ``"net.layers"`` or ``"model.conv1 .. model.avgpool"``."""
        if self.container is not None:
            return self.container
        return self.names[0] if len(self.names) == 1 else f"{self.names[0]} .. {self.names[-1]}"

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return [model.get_submodule(name) for name in self.names]


def container_region(model: nn.Module, name: str) -> Region:
    """The children of the container ``name`` as a region."""
    container = model.get_submodule(name)
    return Region(tuple(f"{name}.{child}" for child, _ in container.named_children()), name)


def find_region(
    model: nn.Module, module_name: str | Sequence[str] | None = None, sample: Any = None
) -> Region:
    """The region to pipeline.

    ``module_name``: the dotted path of an ``nn.Sequential`` or ``nn.ModuleList``, or a list of consecutive
    sibling modules (``["model.conv1", ..., "model.avgpool"]``). Without it, among the outermost containers and,
    when a ``sample`` input of the model's ``forward`` is known, the chains of siblings observed in one forward on
    the meta device, the one holding the most parameters.
    """
    if isinstance(module_name, str):
        module = _get_submodule(model, module_name)
        if not isinstance(module, Container):
            raise TypeError(
                f"module_name={module_name!r} names a {type(module).__name__}, not an nn.Sequential or nn.ModuleList;"
                " point module_name at the container whose blocks should be split into stages, or give a list of"
                " consecutive sibling modules (module_name=['model.conv1', ..., 'model.avgpool'])."
            )
        return container_region(model, module_name)
    if module_name is not None:
        return _sibling_region(model, list(module_name))
    candidates = [container_region(model, name) for name, _ in _outermost_containers(model)]
    if sample is not None:
        candidates += observed_chains(model, sample)
    candidates = [region for region in candidates if len(region) > 0 and not _coarser_than_a_member(model, region)]
    if not candidates:
        raise ValueError(
            f"{type(model).__name__} contains no nn.Sequential or nn.ModuleList to pipeline; hold the blocks to split"
            " in one (e.g. `self.layers = nn.ModuleList(blocks)`), pass module_name=['a', 'b', ...] naming consecutive"
            " sibling modules that the forward calls one after another, or set `example_input_array` so that the"
            " strategy can observe which modules the forward chains."
        )
    return max(candidates, key=lambda region: (num_parameters(model, region), len(region)))


def _coarser_than_a_member(model: nn.Module, region: Region) -> bool:
    """Whether ``region`` is a chain one of whose members is a container of at least as many blocks: the chain
    ``blocks, norm, head`` around an ``nn.Sequential`` of 8 blocks would put all 8 on one stage; the container splits
    finer (a ResNet's ``conv1 .. avgpool`` chain of 9 keeps its 2-block ``layer4``)."""
    if region.container is not None:
        return False
    blocks = region.blocks(model)
    return any(isinstance(block, Container) and len(block) >= len(blocks) for block in blocks)


def num_parameters(model: nn.Module, region: Region) -> int:
    """Parameters of the region's blocks (each counted once)."""
    seen = {id(p): p.numel() for block in region.blocks(model) for p in block.parameters()}
    return sum(seen.values())


def outside_parameters(model: nn.Module, region: Region) -> list[tuple[str, int]]:
    """The modules (and loose parameters) outside the region that hold parameters, outermost first, with their
    parameter counts: what every stage holds and runs whole. A tied weight counts once, where it first appears."""
    inside = set(region.names)
    seen = {id(p) for block in region.blocks(model) for p in block.parameters()}
    found: list[tuple[str, int]] = []

    def count(parameters: Any) -> int:
        new = [p for p in parameters if id(p) not in seen]
        seen.update(id(p) for p in new)
        return sum(p.numel() for p in new)

    def visit(module: nn.Module, prefix: str) -> None:
        for name, parameter in module.named_parameters(recurse=False):
            if n := count([parameter]):
                found.append((f"{prefix}{name}", n))
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if path in inside:
                continue
            if any(block.startswith(path + ".") for block in inside):
                visit(child, path + ".")
            elif n := count(child.parameters()):
                found.append((path, n))

    visit(model, "")
    return found


def observed_chains(model: nn.Module, sample: Any) -> list[Region]:
    """Chains of sibling modules that one forward of ``model`` on ``sample`` calls one after another (each call's
    first argument is the previous call's output), found on the meta device: no memory, no change to the model."""
    calls: list[tuple[str, nn.Module, Any, Any]] = []  # (name, module, first argument, output)
    handles: list[RemovableHandle] = []
    names = {module: name for name, module in model.named_modules() if name}

    def record(module: nn.Module, args: tuple, output: Any) -> None:
        if module in names and args:
            calls.append((names[module], module, args[0], output))

    for module in names:
        handles.append(module.register_forward_hook(record))
    try:
        meta_state = {name: torch.empty_like(t, device="meta") for name, t in model.state_dict(keep_vars=True).items()}
        with torch.no_grad():
            torch.func.functional_call(model, meta_state, _to_meta(sample) if isinstance(sample, tuple) else (_to_meta(sample),), strict=False)
    except Exception:  # a forward that cannot run on the meta device: containers only
        return []
    finally:
        for handle in handles:
            handle.remove()
    chains: list[Region] = []
    by_parent: dict[str, list[tuple[str, Any, Any]]] = {}
    for name, _, first, output in calls:  # calls complete inner-first; siblings keep their order
        parent = name.rpartition(".")[0]
        by_parent.setdefault(parent, []).append((name, first, output))
    for parent, sequence in by_parent.items():
        if isinstance(model.get_submodule(parent) if parent else model, Container):
            continue  # a container's children are a region already
        run = [sequence[0]]
        for call in sequence[1:]:
            if call[1] is run[-1][2] and call[0] not in {name for name, _, _ in run}:
                run.append(call)
                continue
            if len(run) >= MIN_CHAIN:
                chains.append(Region(tuple(name for name, _, _ in run), None))
            run = [call]
        if len(run) >= MIN_CHAIN:
            chains.append(Region(tuple(name for name, _, _ in run), None))
    return chains


def _sibling_region(model: nn.Module, names: list[str]) -> Region:
    if not names:
        raise ValueError("module_name=[] names no modules; give the consecutive sibling modules to pipeline.")
    for name in names:
        _get_submodule(model, name)
    parents = {name.rpartition(".")[0] for name in names}
    if len(parents) != 1:
        raise ValueError(
            f"module_name={names} names modules of different parents ({', '.join(sorted(parents)) or 'the model'});"
            " a chain of modules to pipeline must be children of one module, called one after another."
        )
    parent = parents.pop()
    order = [f"{parent}.{child}" if parent else child for child, _ in (model.get_submodule(parent) if parent else model).named_children()]
    positions = [order.index(name) for name in names]
    if positions != list(range(positions[0], positions[0] + len(names))):
        raise ValueError(
            f"module_name={names} are not consecutive children of {parent or type(model).__name__} (in the order"
            f" they are registered: {order}); list the chain's modules in order, without gaps."
        )
    return Region(tuple(names), None)


def _get_submodule(model: nn.Module, module_name: str) -> nn.Module:
    try:
        return model.get_submodule(module_name)
    except AttributeError:
        available = [name for name, module in model.named_modules() if isinstance(module, Container)]
        raise ValueError(
            f"module_name={module_name!r} does not exist in {type(model).__name__}; the nn.Sequential and"
            f" nn.ModuleList modules it holds are {available or 'none'}."
        ) from None


def _outermost_containers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    found: list[tuple[str, nn.Module]] = []

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(child, Container):
                found.append((path, child))
            else:
                visit(child, path)

    visit(model, "")
    return found


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to("meta")
    if isinstance(value, (tuple, list)):
        return type(value)(_to_meta(item) for item in value)
    if isinstance(value, dict):
        return {key: _to_meta(item) for key, item in value.items()}
    return value
