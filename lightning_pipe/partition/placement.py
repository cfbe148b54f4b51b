"""Where each module outside the pipelined blocks runs: on the stage that needs it, not on every stage.

The training step runs once on the meta device, on the first training batch's shapes (see
:mod:`lightning_pipe.partition.step_probe`). Each call of an outside module labels its output; every operation
passes its inputs' labels on to its outputs, and a block passes none on (what it returns is its own). Where a
call's labels end decides where it must run:

* a call after the model's last block runs on the loss stage only: every other stage ends its step at its last
  block (the final norm, the head, a loss module);
* a call whose output reaches nothing but the hidden input of block ``i`` runs on the stage holding block ``i``:
  the first block (embeddings, a convolutional stem, a patch embedding) or a restart (a decoder's embedding);
* a call whose output reaches another outside module's call runs where that one runs;
* any other call runs on every stage: its output reaches a block's side argument (a rotary embedding's cos and sin,
  a mask), the loss directly, or nothing the probe could see.

A module's place is the union of its calls' places; a module the step never calls stays on every stage.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from lightning_pipe.partition.hooks import hooks_set_aside
from lightning_pipe.partition.meta_run import blocks_answered_when_they_fail, run_on_meta
from lightning_pipe.partition.region import Region, outside_parameters

EVERY = "every"  # runs on every stage
LOSS = "loss"  # runs on the loss stage only
# A place is EVERY, LOSS or the index of the block on whose stage it runs.
Place = int | str


@dataclass(frozen=True)
class OutsidePlaces:
    """Where each outside module runs: ``places[name]`` is a set of places (block indices, :data:`LOSS`), or
    ``{EVERY}``. ``modules`` lists the outside modules in the model's order."""

    places: dict[str, frozenset[Place]]
    # Why the training step could not be followed on the meta device (its error), if it could not: every outside
    # module then stays on every stage (see `unobserved_note`).
    unobserved: str | None = None

    def stages(self, name: str, block_stage: Callable[[int], int], loss_stage: int, num_stages: int) -> frozenset[int]:
        """The stages that hold module ``name``, given the stage of each block and the loss stage."""
        places = self.places.get(name, frozenset({EVERY}))
        if EVERY in places:
            return frozenset(range(num_stages))
        return frozenset(loss_stage if place == LOSS else block_stage(place) for place in places)  # type: ignore[arg-type]

    def describe(self, name: str, block_names: Sequence[str]) -> str:
        """Where module ``name`` runs, in words for the stage table."""
        places = self.places.get(name, frozenset({EVERY}))
        if EVERY in places:
            return "every stage"
        words = ["the loss stage" if p == LOSS else f"the stage of {block_names[p]}" for p in sorted(places, key=str)]  # type: ignore[index]
        return ", ".join(words)

def outside_modules(model: nn.Module, region: Region) -> list[str]:
    """The outermost modules outside the region that hold parameters and share none with a block, in the model's
    order: each is held whole by the stages that run it. A module sharing a parameter with a block, and loose
    parameters of the region's ancestors, stay on every stage."""
    inside = set(region.names)
    block_parameters = {id(p) for block in region.blocks(model) for p in block.parameters()}
    found: list[str] = []

    def visit(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if path in inside:
                continue
            if any(block.startswith(path + ".") for block in inside):
                visit(child, path + ".")
                continue
            parameters = list(child.parameters())
            if parameters and not any(id(p) in block_parameters for p in parameters):
                found.append(path)

    visit(model, "")
    return found


def observe_places(
    model: nn.Module, region: Region, calling: Callable[[nn.Module], Any], names: Sequence[str] | None = None
) -> OutsidePlaces:
    """Where each outside module (``names``, by default :func:`outside_modules`) runs in ``calling(model)`` (the
    training step on a batch's shapes), observed on the meta device as this module's docstring says."""
    names = list(outside_modules(model, region) if names is None else names)
    observer = _FlowObserver(model, region, names)
    finished: list[Any] = []
    errors: list[Exception] = []

    def step(model: nn.Module) -> Any:
        finished.append(output := calling(model))
        return output

    # A block whose code depends on values (a mixture of experts) cannot run on the meta device: answered by its
    # input's shapes, the step goes on past it (only where values go is observed, never what they are).
    blocks, failed_blocks = region.blocks(model), []
    with hooks_set_aside(model.modules()), observer.hooks(), blocks_answered_when_they_fail(blocks, failed_blocks):
        run_on_meta(model, step, extra_modes=[observer.mode], errors=errors)
    if not finished:  # the step failed part-way on the meta device: where its outputs went is not known
        error = errors[0] if errors else None
        why = f"{type(error).__name__}: {_first_line(error)}" if error is not None else "it did not finish"
        return OutsidePlaces({name: frozenset({EVERY}) for name in names}, unobserved=why)
    observer.reached(finished[0], ("loss",))
    called = {name: places for name in names if (places := observer.places_of(name)) is not None}
    return OutsidePlaces({name: called.get(name) or _places_of_uncalled(model, name, called) for name in names})


def unobserved_note(places: OutsidePlaces, model: nn.Module, region: Region) -> str | None:
    """What the start-up says when the training step could not be followed on the meta device: why, and that every
    module outside the blocks therefore stays on every stage (named, with its share of the parameters)."""
    if places.unobserved is None or not places.places:
        return None
    names = list(places.places)
    counts = {name: sum(p.numel() for p in model.get_submodule(name).parameters()) for name in names}
    total = sum(p.numel() for p in model.parameters()) or 1
    listed = ", ".join(f"{name} ({counts[name] / total:.0%})" for name in names)
    return (
        f"The training step could not run on the meta device on the first batch's shapes ({places.unobserved}),"
        " so where the modules outside the pipelined blocks are needed could not be seen: they stay on every stage,"
        f" each held and run by every stage: {listed}. Training is as on one device; only the memory and the time"
        " of those modules are spent on every stage. To place them (an embedding on the first stage, a head and a"
        " loss on the last), make the code outside the blocks runnable on the meta device: it cannot read values"
        " (a Python number from a tensor, torch.nonzero, indexing by a boolean mask)."
    )


def parameter_holders(
    model: nn.Module, module_stages: Mapping[str, frozenset[int]]
) -> tuple[dict[str, frozenset[int]], dict[str, int], dict[str, list[str]]]:
    """For each parameter of the outside modules (named by its first name in ``model``), the stages holding it (the
    union of its modules' ``module_stages``), the stage whose value they start from (one device initialises a
    parameter shared by modules with the last of them) and every name it goes by."""
    aliases: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(parameter), []).append(name)
    holders: dict[str, frozenset[int]] = {}
    source: dict[str, int] = {}
    for module_name in [name for name, _ in model.named_modules() if name in module_stages]:
        stages = module_stages[module_name]
        for parameter in model.get_submodule(module_name).parameters():
            first = aliases[id(parameter)][0]
            holders[first] = holders.get(first, frozenset()) | stages
            source[first] = min(stages)
    return holders, source, {names[0]: names for names in aliases.values() if names[0] in holders}


def _places_of_uncalled(model: nn.Module, name: str, called: Mapping[str, frozenset[Place]]) -> frozenset[Place]:
    """A module the step never called whose parameters all belong to called modules too (T5's ``shared``, the
    embedding that its encoder's and decoder's ``embed_tokens`` use) is where those are; any other, on every stage."""
    own = {id(p) for p in model.get_submodule(name).parameters()}
    sharing = [other for other in called if own & {id(p) for p in model.get_submodule(other).parameters()}]
    covered = {id(p) for other in sharing for p in model.get_submodule(other).parameters()}
    if not sharing or not own <= covered:
        return frozenset({EVERY})
    return frozenset().union(*(called[other] for other in sharing))


# Labels are call numbers; a sink is where a call's labels ended: ("block", i), ("side",), ("call", j), ("loss",).
_Sink = tuple


class _FlowObserver:
    """Follows the outside modules' outputs through the step (see the module's docstring)."""

    def __init__(self, model: nn.Module, region: Region, names: list[str]) -> None:
        self.model = model
        self.region = region
        self.names = names
        self.labels: WeakIdKeyDictionary = WeakIdKeyDictionary()  # tensor -> frozenset of call numbers
        self.calls: list[str] = []  # call number -> module name
        self.after_last_block: list[bool] = []  # call number -> whether made after the model's last block
        self.sinks: list[set[_Sink]] = []
        self.depth = 0  # inside a block or an outside module: operations there do not propagate labels
        self.blocks_done = False
        self.mode = _Propagation(self)

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        handles = []
        last = len(self.region) - 1
        for index, block in enumerate(self.region.blocks(self.model)):
            handles.append(block.register_forward_pre_hook(self._block_pre(index), with_kwargs=True))
            handles.append(block.register_forward_hook(self._block_post(index == last), with_kwargs=True))
        for name in self.names:
            module = self.model.get_submodule(name)
            handles.append(module.register_forward_pre_hook(self._outside_pre, with_kwargs=True))
            handles.append(module.register_forward_hook(self._outside_post(name), with_kwargs=True))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def reached(self, value: Any, sink: _Sink) -> None:
        for tensor in tree_leaves(value):
            if isinstance(tensor, Tensor):
                for call in self.labels.get(tensor, ()):
                    self.sinks[call].add(sink)

    def _block_pre(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if self.depth == 0:
                self.reached(args[:1], ("block", index))
                self.reached((args[1:], kwargs), ("side",))
            self.depth += 1

        return hook

    def _block_post(self, last: bool) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            self.depth -= 1
            if self.depth == 0 and last:
                self.blocks_done = True

        return hook

    def _outside_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.depth == 0:
            self.reached((args, kwargs), ("call", len(self.calls)))
        self.depth += 1

    def _outside_post(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            self.depth -= 1
            if self.depth > 0:
                return
            call = len(self.calls)
            self.calls.append(name)
            self.after_last_block.append(self.blocks_done)
            self.sinks.append(set())
            for tensor in tree_leaves(output):
                if isinstance(tensor, Tensor):
                    self.labels[tensor] = frozenset({call})

        return hook

    def places_of(self, name: str) -> frozenset[Place] | None:
        """Where module ``name`` must run; ``None`` if the step never called it."""
        calls = [call for call, called in enumerate(self.calls) if called == name]
        if not calls:
            return None
        places: set[Place] = set()
        for call in calls:
            places |= self._call_places(call)
        return frozenset({EVERY}) if EVERY in places else frozenset(places)

    def _call_places(self, call: int) -> set[Place]:
        if self.after_last_block[call]:
            return {LOSS}
        sinks = self.sinks[call]
        if not sinks:
            return {EVERY}
        places: set[Place] = set()
        for sink in sinks:
            if sink[0] == "block":
                places.add(sink[1])
            elif sink[0] == "call" and sink[1] > call:
                places |= self._call_places(sink[1])
            else:
                return {EVERY}
        return places


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else ""


class _Propagation(TorchDispatchMode):
    """Passes the labels of an operation's tensor inputs on to its tensor outputs (outside blocks and modules)."""

    # Operations whose output takes only the input's shape, dtype and device, not its values.
    _SHAPE_ONLY = frozenset(
        name for name in ("new_empty", "new_zeros", "new_ones", "new_full", "empty_like", "zeros_like", "ones_like",
                          "full_like", "rand_like", "randn_like", "randint_like", "new_empty_strided", "sym_size",
                          "sym_stride", "sym_numel", "sym_storage_offset")
    )

    def __init__(self, observer: _FlowObserver) -> None:
        super().__init__()
        self.observer = observer

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        observer = self.observer
        if observer.depth > 0 or func.__name__.split(".")[0] in self._SHAPE_ONLY:
            return output
        labels: frozenset[int] = frozenset()
        for tensor in tree_leaves((args, kwargs)):
            if isinstance(tensor, Tensor):
                labels |= observer.labels.get(tensor, frozenset())
        if labels:
            mutated = [a for a, schema in zip(args, func._schema.arguments) if schema.alias_info is not None and schema.alias_info.is_write]
            for tensor in [*tree_leaves(output), *mutated]:
                if isinstance(tensor, Tensor):
                    observer.labels[tensor] = observer.labels.get(tensor, frozenset()) | labels
        return output


def balance_charges(module: nn.Module, region: Region, places: OutsidePlaces) -> list[tuple[int, nn.Module]]:
    """The outside modules the balance charges to a block's stage: each module held by some stages only, at the
    block it runs with (the last block for the loss stage's)."""
    charges = []
    for name, where in places.places.items():
        if EVERY not in where:
            for place in where:
                charges.append((len(region) - 1 if place == LOSS else int(place), module.get_submodule(name)))
    return charges


def outside_rows(
    module: nn.Module, region: Region, module_stages: dict[str, frozenset[int]], num_stages: int
) -> list[tuple[str, int, str]]:
    """The stage table's rows for what is outside the blocks: each module (or loose parameter), its parameters (a
    tied one counted where it first appears) and which stages hold it."""
    seen = {id(p) for block in region.blocks(module) for p in block.parameters()}
    rows = []
    for name, stages in module_stages.items():
        new = [p for p in module.get_submodule(name).parameters() if id(p) not in seen]
        seen.update(id(p) for p in new)
        rows.append((name, sum(p.numel() for p in new), where_held(stages, num_stages)))
    listed = tuple(f"{name}." for name in module_stages)
    for name, count in outside_parameters(module, region):
        if name not in module_stages and not name.startswith(listed):
            rows.append((name, count, "every stage"))
    return rows


def where_held(stages: frozenset[int], num_stages: int) -> str:
    if len(stages) == num_stages:
        return "every stage"
    return f"stage{'s' if len(stages) > 1 else ''} {', '.join(map(str, sorted(stages)))}"


def replicated_outside_parameters(
    module: nn.Module, region: Region, holders: dict[str, frozenset[int]], names_of: dict[str, list[str]],
    num_stages: int,
) -> list[nn.Parameter]:
    """The parameters outside the blocks that every stage holds: in no outside module held by fewer stages."""
    first_name = {alias: first for first, names in names_of.items() for alias in names}
    fewer = {first for first, stages in holders.items() if len(stages) < num_stages}
    return [p for name, p in _named_outside_parameters(module, region) if first_name.get(name, name) not in fewer]


def _named_outside_parameters(module: nn.Module, region: Region) -> list[tuple[str, nn.Parameter]]:
    """Each parameter outside the region's blocks once, under its first name outside them."""
    inside = tuple(f"{name}." for name in region.names)
    seen: set[int] = set()
    found = []
    for name, parameter in module.named_parameters(remove_duplicate=False):
        if not name.startswith(inside) and id(parameter) not in seen:
            seen.add(id(parameter))
            found.append((name, parameter))
    return found
