"""Which blocks of a model to pipeline: a container's children, or a chain of sibling modules.

A region is the ordered list of blocks that the model's own code calls one after another, each call's first
argument being the previous call's output: the children of an ``nn.Sequential`` (called whole, or iterated) or
an ``nn.ModuleList`` (iterated by the model's loop, as Hugging Face models and ``nn.TransformerEncoder`` do), or
consecutive children of one module called in its ``forward`` (``conv1, bn1, relu, maxpool, layer1..layer4,
avgpool`` in a ResNet). The region is replaced at set-up by this rank's blocks and stand-ins for the others
(:mod:`lightning_pipe.execution.stage`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_pipe.partition.balance import min_max_partition, ranges_from_sizes, stage_costs
from lightning_pipe.partition.hooks import hooks_set_aside
from lightning_pipe.partition.meta_run import run_on_meta

Container = (nn.Sequential, nn.ModuleList)
# NOTE: two chained modules are most often a body and its head (`head(net(x))`): pipelined as two blocks, the body
# would be one stage whole, where its own nn.Sequential splits evenly. A chain counts from three modules on, unless
# nothing finer keeps most parameters in the pipeline (see `find_region`); any chain can be named with
# module_name=[...].
MIN_CHAIN = 3
# The share of the model's parameters outside the region (run whole on every stage) above which the strategy looks
# for a larger region, and warns if it finds none.
MAX_OUTSIDE_SHARE = 0.2


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
    model: nn.Module,
    module_name: str | Sequence[str] | None = None,
    sample: Any = None,
    step: Callable[[nn.Module], Any] | None = None,
    num_stages: int | None = None,
) -> Region:
    """The region to pipeline.

    ``module_name``: the dotted path of an ``nn.Sequential`` or ``nn.ModuleList``, or a list of consecutive
    sibling modules (``["model.conv1", ..., "model.avgpool"]``). Without it, among the outermost containers and,
    when a ``sample`` input of the model's ``forward`` is known, the chains of siblings observed in one forward on
    the meta device, the one holding the most parameters.

    When that one leaves more than ``MAX_OUTSIDE_SHARE`` of the parameters outside (every stage would hold and run
    them), the shorter or coarser chains observed (and, with ``step``, the chains that ``step(model)`` calls: the
    training step on a batch's shapes) are weighed too, given ``num_stages``: a chain replaces it if its largest stage,
    with what every stage holds besides, is smaller (Lightning's autoencoder: ``encoder, decoder``, called by
    ``training_step``, not by ``forward``).
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
    region = _largest_region(model, sample, step, num_stages)
    if region is None:
        raise ValueError(
            f"{type(model).__name__} contains no nn.Sequential or nn.ModuleList to pipeline; hold the blocks to split"
            " in one (e.g. `self.layers = nn.ModuleList(blocks)`), pass module_name=['a', 'b', ...] naming"
            " consecutive sibling modules that the forward calls one after another, or set `example_input_array` so"
            " that the strategy can observe which modules the forward chains."
        )
    return region


def _largest_region(
    model: nn.Module, sample: Any, step: Callable[[nn.Module], Any] | None, num_stages: int | None
) -> Region | None:
    """What :func:`find_region` chooses without ``module_name``; ``None`` where it finds nothing to pipeline."""
    candidates = [container_region(model, name) for name, _ in _outermost_containers(model)]
    chains = observed_chains(model, partial(_forward, sample)) if sample is not None else []
    fine = [r for r in [*candidates, *(c for c in chains if len(c) >= MIN_CHAIN)] if len(r) > 0]
    fine = [region for region in fine if not _coarser_than_a_member(model, region)]
    best = max(fine, key=lambda region: (num_parameters(model, region), len(region))) if fine else None
    if best is not None and (num_stages is None or outside_share(model, best) <= MAX_OUTSIDE_SHARE):
        return best
    if num_stages is not None:
        if step is not None:
            chains += observed_chains(model, step)
        weighed = [*([best] if best is not None else []), *(c for c in chains if c not in fine)]
        if weighed:  # the first of equals: the container or fine chain
            return min(weighed, key=lambda region: largest_stage(model, region, num_stages))
    return best


class TooFewBlocks(ValueError):
    """The region has fewer blocks than the pipeline has model chunks. ``step_unread``: the training step, whose
    chains might have given a longer region, was not observed because its batch could not be read (before the
    processes start, from a DataModule: set-up, where the batch can be read, decides)."""

    def __init__(self, message: str, step_unread: bool) -> None:
        super().__init__(message)
        self.step_unread = step_unread


def chosen_region(
    model: nn.Module,
    module_name: str | Sequence[str] | None,
    sample: Any,
    read_step: Callable[[], Callable[[nn.Module], Any] | None] | None,
    num_stages: int,
    virtual_stages: int = 1,
) -> Region:
    """The region to pipeline over ``num_stages`` stages of ``virtual_stages`` chunks: :func:`find_region`'s, and
    where that leaves more than ``MAX_OUTSIDE_SHARE`` of the parameters outside or finds nothing, also the chains
    that the training step calls. ``read_step()`` gives the step on the first training batch's shapes (``None``
    where that batch cannot be read); ``read_step`` is ``None`` outside a fit. A region of fewer blocks than chunks
    is refused (:class:`TooFewBlocks`), naming it, why it was chosen, and the fixes."""
    step, read = None, False
    try:
        region = find_region(model, module_name, sample, num_stages=num_stages)
    except ValueError:
        if module_name is not None or read_step is None:
            raise
        region = None
    much_outside = region is None or outside_share(model, region) > MAX_OUTSIDE_SHARE
    if module_name is None and read_step is not None and much_outside:
        read, step = True, read_step()
        if step is not None:
            region = find_region(model, None, sample, step, num_stages)
        elif region is None:
            region = find_region(model, None, sample, num_stages=num_stages)  # raises, naming the fixes
    assert region is not None
    chunks = num_stages * virtual_stages
    if len(region) < chunks:
        observed = [*(["the forward on the sample input"] if sample is not None else []),
                    *(["the training step on the first training batch"] if step is not None else [])]
        unread = read and step is None
        message = too_few_blocks_message(
            model, region, module_name, num_stages, virtual_stages, observed, unread, outside_a_fit=read_step is None
        )
        raise TooFewBlocks(message, step_unread=unread)
    return region


def too_few_blocks_message(
    model: nn.Module, region: Region, module_name: str | Sequence[str] | None, num_stages: int, virtual_stages: int,
    observed: Sequence[str], step_unread: bool, outside_a_fit: bool,
) -> str:
    """Why ``region`` cannot be cut into ``num_stages * virtual_stages`` chunks: the region, how it was chosen,
    what was observed, and the fixes (a ``module_name=[...]`` chain, ``example_input_array``, fewer stages)."""
    chunks = num_stages * virtual_stages
    counts = f"num_stages={num_stages}" + (f" with virtual_stages={virtual_stages}" if virtual_stages > 1 else "")
    blocks = f"{len(region)} block{'s' if len(region) != 1 else ''}"
    if region.container is not None:
        held = f"'{region.container}' (an nn.{type(model.get_submodule(region.container)).__name__} of {blocks})"
    else:
        held = f"the chain '{region.label}' ({blocks})"
    if module_name is not None:
        why = f"module_name={module_name!r} names {held}"
    else:
        seen = " or ".join(observed)
        chosen = ("the container holding the most parameters" if region.container is not None
                  else f"the chain observed in {seen} that splits best")
        why = f"the pipelined blocks are {held}, {chosen}"
        if (share := outside_share(model, region)) > 0:
            why += f" ({1 - share:.0%} of the model's; the other {share:.0%} would run whole on every stage)"
        if observed and region.container is not None:
            why += f"; no chain observed in {seen} holds more blocks"
        elif not observed:
            unseen = ("the first training batch could not be read here" if step_unread
                      else "this is not a fit, whose training step could show them" if outside_a_fit
                      else "the training step was not run")
            why += (". The chains of modules the model calls could not be observed: it has no example_input_array"
                    f" (nor GPipeStrategy(sample=...)), and {unseen}")
    fixes = []
    if (chain := enclosing_chain(model, region, chunks)) is not None:
        fixes.append(f"name the chain of modules around it, if the model calls them one after another in this order:"
                     f" module_name={chain}")
    if module_name is None and not observed:
        fixes.append("set `self.example_input_array = <an input of forward>` in the module's __init__, so that the"
                     " strategy observes the chain the forward calls")
    stages = max(1, len(region) // virtual_stages)
    fixes.append(f"use at most {stages} stage{'s' if stages != 1 else ''}")
    return f"{counts} needs at least {chunks} blocks to pipeline, but {why}; {', or '.join(fixes)}."


def enclosing_chain(model: nn.Module, region: Region, num_blocks: int) -> list[str] | None:
    """Consecutive children of the region's closest ancestor that holds at least ``num_blocks`` of them, from the
    first that holds parameters to the last (and at least the one holding the region): the chain that
    ``module_name=[...]`` could name to pipeline more of the model than ``region`` does. ``None`` where no ancestor
    has one."""
    path = (region.container if region.container is not None else region.names[0]).split(".")
    while path:
        inner = path[-1]
        path = path[:-1]
        parent = model.get_submodule(".".join(path)) if path else model
        children = [(name, child) for name, child in parent.named_children()]
        names = [name for name, _ in children]
        holding = [i for i, (_, child) in enumerate(children) if next(child.parameters(), None) is not None]
        first = min([*holding, names.index(inner)])
        last = max([*holding, names.index(inner)])
        chain = [".".join([*path, name]) for name in names[first:last + 1]]
        if len(chain) >= num_blocks and tuple(chain) != region.names:
            return chain
    return None


def suggested_chain(model: nn.Module, region: Region) -> list[str] | None:
    """What ``module_name=[...]`` could name to pipeline the largest module outside ``region`` with it: the
    consecutive children of their closest common ancestor, from the one that holds that module to the one that holds
    the region. ``None`` when nothing outside is a module, or the list would be the region itself."""
    modules = [(name, n) for name, n in outside_parameters(model, region) if _is_module(model, name)]
    if not modules:
        return None
    largest = max(modules, key=lambda item: item[1])[0].split(".")
    inner = (region.container if region.container is not None else region.names[0]).split(".")
    depth = 0
    while depth < min(len(largest), len(inner)) - 1 and largest[depth] == inner[depth]:
        depth += 1
    parent = ".".join(largest[:depth])
    children = [name for name, _ in (model.get_submodule(parent) if parent else model).named_children()]
    first, last = sorted((children.index(largest[depth]), children.index(inner[depth])))
    chain = [f"{parent}.{child}" if parent else child for child in children[first:last + 1]]
    return chain if len(chain) > 1 and tuple(chain) != region.names else None


def _is_module(model: nn.Module, name: str) -> bool:
    try:
        return isinstance(model.get_submodule(name), nn.Module)
    except AttributeError:
        return False


def outside_share(model: nn.Module, region: Region) -> float:
    """The share of the model's parameters outside ``region``: held and run whole on every stage."""
    outside = sum(n for _, n in outside_parameters(model, region))
    total = outside + num_parameters(model, region)
    return outside / total if total else 0.0


def largest_stage(model: nn.Module, region: Region, num_stages: int) -> float:
    """The parameters of the largest stage, with those outside ``region`` that every stage holds, when the region's
    blocks are split over ``num_stages`` stages as evenly as a contiguous split by parameters allows (infinite for a
    region of fewer blocks than stages)."""
    if len(region) < num_stages:
        return math.inf
    costs = [sum(p.numel() for p in block.parameters()) for block in region.blocks(model)]
    ranges = ranges_from_sizes(min_max_partition(costs, num_stages))
    return max(stage_costs(costs, ranges)) + sum(n for _, n in outside_parameters(model, region))


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


def observed_chains(model: nn.Module, calling: Callable[[nn.Module], Any]) -> list[Region]:
    """Chains of two or more sibling modules that ``calling(model)`` (a forward on a sample, a training step) calls one
    after another (each call's first argument is the previous call's output), and encoder-decoder chains (see
    :func:`_encoder_decoder_chains`), found on the meta device: no memory, no user hook called, and the model as it
    was after (its modules' attributes, such as a cache that a forward builds on its first call, are put back). A run
    that fails part-way (code that cannot run on the meta device) still shows the calls made before."""
    calls: list[_ObservedCall] = []
    handles: list[RemovableHandle] = []
    names = {module: name for name, module in model.named_modules() if name}

    def record(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if module in names and args:
            others = {id(value) for value in [*args[1:], *kwargs.values()] if isinstance(value, torch.Tensor)}
            calls.append(_ObservedCall(names[module], args[0], output, others))

    with hooks_set_aside(model.modules()):
        for module in names:
            handles.append(module.register_forward_hook(record, with_kwargs=True))
        try:
            run_on_meta(model, calling)
        finally:
            for handle in handles:
                handle.remove()
    chains: list[Region] = []
    by_parent: dict[str, list[tuple[str, Any, Any]]] = {}
    for call in calls:  # calls complete inner-first; siblings keep their order
        parent = call.name.rpartition(".")[0]
        by_parent.setdefault(parent, []).append((call.name, call.first, call.output))
    for parent, sequence in by_parent.items():
        if isinstance(model.get_submodule(parent) if parent else model, Container):
            continue  # a container's children are a region already
        run = [sequence[0]]
        for call in sequence[1:]:
            if call[1] is run[-1][2] and call[0] not in {name for name, _, _ in run}:
                run.append(call)
                continue
            if len(run) >= 2:
                chains.append(Region(tuple(name for name, _, _ in run), None))
            run = [call]
        if len(run) >= 2:
            chains.append(Region(tuple(name for name, _, _ in run), None))
    return chains + _encoder_decoder_chains(model, calls)


@dataclass
class _ObservedCall:
    name: str
    first: Any  # the first positional argument
    output: Any
    others: set[int]  # the ids of the other tensor arguments


def _encoder_decoder_chains(model: nn.Module, calls: list[_ObservedCall]) -> list[Region]:
    """Encoder-decoder chains: a container's blocks (the encoder's), the modules the model then calls on their
    output one after another (its final norm), and another container's blocks (the decoder's) whose first block
    takes that output besides its own first argument (the embedded target): ``nn.Transformer``'s
    ``encoder.layers, encoder.norm, decoder.layers``, BART's ``encoder.layers, decoder.layers``."""
    containers = [(name, [f"{name}.{child}" for child, _ in container.named_children()])
                  for name, container in _outermost_containers(model) if len(container) > 0]
    position = {call.name: index for index, call in enumerate(calls)}  # a module called twice: its last call
    once = {name for name in position if sum(call.name == name for call in calls) == 1}
    found = []
    for encoder, encoder_blocks in containers:
        if encoder_blocks[-1] not in position:
            continue
        end = position[encoder_blocks[-1]]
        for decoder, decoder_blocks in containers:
            start = position.get(decoder_blocks[0], -1)
            if decoder == encoder or start < end:
                continue
            output, extension = calls[end].output, []
            for call in calls[end + 1:start]:  # the modules continuing the encoder's chain (its final norm)
                inside = any(call.name.startswith(prefix + ".") for prefix in (encoder, decoder))
                # Not a module the model also calls elsewhere (T5's dropout, before the encoder's blocks and after).
                if not inside and call.name in once and not decoder.startswith(call.name + ".") and _continues(call.first, output):
                    extension.append(call.name)
                    output = call.output
            if any(id(value) in calls[start].others for value in (output, first_item(output)) if value is not None):
                found.append(Region((*encoder_blocks, *extension, *decoder_blocks), None))
    return found


def _continues(first: Any, output: Any) -> bool:
    return first is output or (first_item(output) is not None and first is first_item(output))


def first_item(value: Any) -> Any:
    """``value[0]`` for a tuple or a ``ModelOutput``-like object (a mapping that indexes), else ``None``."""
    if isinstance(value, tuple) and value:
        return value[0]
    if hasattr(value, "to_tuple") and hasattr(value, "__getitem__"):
        items = value.to_tuple()
        return items[0] if items else None
    return None


def _forward(sample: Any, model: nn.Module) -> Any:
    """``model``'s forward on ``sample`` (a tuple is the positional arguments), on the meta device."""
    return model(*_to_meta(sample)) if isinstance(sample, tuple) else model(_to_meta(sample))


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
