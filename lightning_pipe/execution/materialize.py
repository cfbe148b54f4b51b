"""Deferred construction: a model built on the meta device becomes real, initialised tensors where it runs.

A model built in ``LightningModule.configure_model()`` (or under ``trainer.init_module(empty_init=True)``) under the
gpipe strategy has only shapes: its tensors live on the meta device and take no memory. Once the strategy knows
which blocks are this rank's, :func:`materialize` allocates exactly those on the stage's device and initialises
them; the other stages' blocks never take memory here.

Initial weights must not depend on how the model is split, so that runs on 1, 2 or 4 stages start alike. The rule:
every module that holds parameters or buffers of its own is initialised by its initialiser (below), with the
random generators seeded by :func:`layer_seed` from the global seed and the module's qualified name in the
LightningModule (``"net.model.5"``). The name, unlike the order of construction or the stage, is the same whatever
the split. :func:`init_weights` applies the same rule to a model built with real tensors, which is how a run
without this strategy (one device, ``strategy="auto"``) starts from the same weights.

Which initialiser fills a module, the first that applies:

1. the user's ``init_module(name, module)`` (``GPipeStrategy(init_module=...)``), for every module, when given: the
   user's whole rule, replacing the two below;
2. inside a Hugging Face ``PreTrainedModel``: ``reset_parameters()`` if the module has one (what its constructor
   ran), then the nearest enclosing ``PreTrainedModel``'s ``_init_weights(module)`` (what ``post_init`` applies when
   transformers builds the model with real tensors: normal(0, ``initializer_range``) for linear layers and
   embeddings, padding rows zeroed, norms to one, rotary frequencies computed). That holds for modules that have a
   ``reset_parameters()`` too (``nn.Linear``): the model's own initialisation is what a user building it on the
   CPU gets, and what its training recipe assumes. As transformers does (children first), every module of the model
   is visited after its children, those without tensors of their own too: GPT-2's attention rescales its output
   projection's weight there. Its ``_init_weights`` writes only the tensors this call initialises (the others,
   pretrained or real, are marked as transformers marks loaded weights);
3. ``reset_parameters()``.

A module with none of them is refused, naming the ways out. Tensors allocated here that no initialiser wrote are
refused too (they would hold whatever the memory held). Assumed, as of every model of transformers: one module's
``_init_weights`` draws for the tensors of one block at most, never across blocks (which would make the values
depend on which blocks are on the rank). A parameter shared by several modules takes the values the last of them
(in the model's order) gives it, as with real tensors the last module to initialise it decides: for an embedding
tied to the output projection that is the projection's initialisation (transformers ties after initialising, so the
embedding's decides there: the two differ in the padding row, which transformers zeroes).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
from collections.abc import Callable, Collection, Generator, Iterator
from contextlib import contextmanager
from functools import partial
from typing import NamedTuple

import torch
from torch import Tensor, nn

from lightning_pipe.execution.random_streams import hashed_seed, seeded


def layer_seed(seed: int, name: str) -> int:
    """The seed that initialises the module called ``name`` (its qualified name in the LightningModule) when the
    run's global seed is ``seed``. A hash, so that neighbouring layers get unrelated random streams."""
    return hashed_seed(f"{seed}/{name}".encode())


def global_seed() -> int:
    """The run's global seed: the one ``seed_everything`` set (``PL_GLOBAL_SEED``), else torch's initial seed."""
    seed = os.environ.get("PL_GLOBAL_SEED")
    return int(seed) if seed is not None else torch.initial_seed()


def holds_meta_tensors(module: nn.Module, recurse: bool = True) -> bool:
    """Whether ``module`` (with its children when ``recurse``) has a parameter or buffer on the meta device."""
    return any(t.is_meta for t in _tensors(module, recurse))


ModuleInit = Callable[[str, nn.Module], None]
"""A user's initialiser (``GPipeStrategy(init_module=...)``): called as ``init_module(name, module)`` for every module
holding parameters or buffers of its own, ``name`` its qualified name in the LightningModule, it fills them in place
(the random generators already seeded by the name)."""


def materialize(
    root: nn.Module, device: torch.device, seed: int, filled: Collection[str] = (),
    init_module: ModuleInit | None = None,
) -> list[str]:
    """Allocate every meta tensor of ``root`` on ``device`` and initialise it by the rule in this module's docstring.

    ``root`` is the LightningModule after the strategy replaced the pipelined ``nn.Sequential`` by this rank's stage,
    so what is left on meta is exactly what this rank needs: its stage's blocks and the replicated modules outside
    the pipeline. Tensors already real are left alone. Parameters tied between modules stay tied. ``filled``: the
    names (state-dict keys, ``"blocks.3.weight"``) of tensors the caller fills next from pretrained weights; they
    are allocated and not initialised, so a module all of whose meta tensors are filled needs no initialiser, and a
    module whose parameters are filled but whose buffers are not (rotary frequencies, computed when the model is
    built) has them filled by its Hugging Face model's ``_init_weights``, as ``from_pretrained`` fills them.
    ``init_module``: the user's initialiser (:data:`ModuleInit`), which then replaces the built-in rule.
    Returns the qualified names of the modules whose tensors it initialised, each after its children.
    """
    holders = _meta_parameter_holders(root)
    owners = _pretrained_owners(root)
    initialisers: dict[str, _Initialiser] = {}
    fresh: list[tuple[str, nn.Module, str]] = []  # (module name, module, tensor name): allocated here, to initialise
    for name, module in root.named_modules():
        if not holds_meta_tensors(module, recurse=False):
            continue
        if getattr(module, _HELD_ELSEWHERE, False):
            raise RuntimeError(
                f"module {name!r} ({type(module).__name__}) is on the meta device here because a previous run with"
                " the gpipe strategy trained it on another rank (a model built on the meta device stays distributed"
                " after fit); a new split, or another process, now places it here. Run with the same split, or load"
                " the weights from a"
                " checkpoint into a fresh model (`Model.load_from_checkpoint(path)` or `trainer.fit(model,"
                " ckpt_path=path)` with a model built in configure_model)."
            )
        prefix = f"{name}." if name else ""
        unfilled = [n for n, t in _named_tensors(module) if t.is_meta and f"{prefix}{n}" not in filled]
        if unfilled:
            initialisers[name] = _initialiser(name, module, owners.get(name), init_module, "on the meta device")
        module.to_empty(device=device, recurse=False)
        fresh += [(name, module, tensor_name) for tensor_name in unfilled]
    tensors = [getattr(module, tensor_name) for _, module, tensor_name in fresh]
    with torch.no_grad():
        for tensor in tensors:
            if _checkable(tensor):
                tensor.fill_(float("nan"))  # what no initialiser writes shows (see `_check_written`)
    initialised = _initialise(root, initialisers, {id(t) for t in tensors}, seed, owners, init_module is None)
    _retie(holders)
    _check_written(fresh, initialisers)
    _check_metrics(root)
    return initialised


def init_weights(module: nn.Module, seed: int | None = None, init_module: ModuleInit | None = None) -> list[str]:
    """Initialise ``module``'s weights by the stage-count-independent rule, as the gpipe strategy does on its own.

    Call it with the LightningModule at the end of ``configure_model()`` to start a run without the gpipe strategy
    (one device) from the weights a pipeline of any length starts from::

        def configure_model(self):
            if self.blocks is not None:  # configure_model runs again for trainer.test/validate/predict
                return
            self.blocks = nn.Sequential(*[Block(d) for _ in range(n)])
            lightning_pipe.init_weights(self)

    Every module holding parameters or buffers of its own is initialised by the rule in this module's docstring
    (``init_module``, else its Hugging Face model's ``_init_weights`` after its ``reset_parameters()``, else its
    ``reset_parameters()``), with the random generators of its tensors' device seeded by ``layer_seed(seed, name)``
    (``name`` relative to ``module``, so pass the LightningModule); the global random state is left as it was.
    Modules with no initialiser keep the values they were built with. Tensors still on the meta device (under the
    gpipe strategy) are skipped: the strategy initialises them by the same rule when it materialises them on their
    stage. ``seed`` defaults to :func:`global_seed`; pass the strategy's ``init_module``, if any, here too. Returns
    the qualified names of the modules it initialised, each after its children.
    """
    seed = global_seed() if seed is None else seed
    owners = _pretrained_owners(module)
    initialisers: dict[str, _Initialiser] = {}
    fresh: set[int] = set()
    for name, submodule in module.named_modules():
        own = list(_tensors(submodule, recurse=False))
        if not own or any(t.is_meta for t in own):
            continue
        initialiser = _initialiser(name, submodule, owners.get(name), init_module, None)
        if initialiser is not None:
            initialisers[name] = initialiser
            fresh.update(id(t) for t in own)
    return _initialise(module, initialisers, fresh, seed, owners, init_module is None)


def mark_held_elsewhere(modules: list[nn.Module]) -> None:
    """Record that these meta modules (and their submodules) stand for trained weights another rank holds, so that
    a later :func:`materialize` refuses to re-initialise them instead of silently discarding the training. The mark
    is an attribute of each module: it travels with the model to the processes of a spawn launcher."""
    for module in modules:
        for submodule in module.modules():
            setattr(submodule, _HELD_ELSEWHERE, True)


def _tensors(module: nn.Module, recurse: bool) -> Iterator[Tensor]:
    return itertools.chain(module.parameters(recurse=recurse), module.buffers(recurse=recurse))


def _named_tensors(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """The module's own parameters and buffers (not its children's), by name."""
    return itertools.chain(module.named_parameters(recurse=False), module.named_buffers(recurse=False))


class _Initialiser(NamedTuple):
    run: Callable[[], None]
    described: str  # for messages: "Scale.reset_parameters()"


def _initialiser(
    name: str, module: nn.Module, owner: nn.Module | None, init_module: ModuleInit | None, required: str | None
) -> _Initialiser | None:
    """What fills ``module``'s tensors (the rule in this module's docstring). When nothing applies: ``None``, or,
    where it is ``required`` (``"on the meta device"``: where its tensors are), a ``TypeError`` naming the ways out."""
    kind = type(module).__name__
    if init_module is not None:
        return _Initialiser(partial(init_module, name, module), f"init_module({name!r}, {kind})")
    reset = getattr(module, "reset_parameters", None)
    if owner is not None:
        def initialise() -> None:
            if callable(reset):
                reset()
            owner._init_weights(module)
        return _Initialiser(initialise, f"{type(owner).__name__}._init_weights({kind})")
    if callable(reset):
        return _Initialiser(reset, f"{kind}.reset_parameters()")
    if required is None:
        return None
    tensors = [tensor_name for tensor_name, _ in _named_tensors(module)]
    raise TypeError(
        f"module {name or '(the LightningModule)'!r} ({kind}) holds tensors {tensors} {required} but nothing"
        " initialises them once they are allocated on their stage: it has no reset_parameters() and is not part of"
        f" a Hugging Face PreTrainedModel. Either define `{kind}.reset_parameters(self)` that fills them (as"
        " nn.Linear's does); or pass `GPipeStrategy(init_module=fn)`, where `fn(name, module)` initialises every"
        " module holding tensors (and `lightning_pipe.init_weights(model, init_module=fn)` starts one device"
        " alike; docs/memory.md); or create the module outside configure_model()."
    )


def _initialise(
    root: nn.Module, initialisers: dict[str, _Initialiser], fresh: set[int], seed: int,
    owners: dict[str, nn.Module], hf_parents: bool,
) -> list[str]:
    """Run the initialisers, each module's after its children's (the order transformers initialises in), each with
    the random generators seeded by the module's name. With ``hf_parents``, a module of a Hugging Face model that
    has none of its own but whose children were initialised runs its model's ``_init_weights`` too, as transformers
    does (GPT-2's attention and MLP rescale their output projection there). Inside Hugging Face models only the
    ``fresh`` tensors (by id) are written; the others are marked as transformers marks the weights it loaded."""
    above = {name.rpartition(".")[0] for name in initialisers}  # parents, then theirs: those of initialised modules
    for name in list(above):
        while name:
            name = name.rpartition(".")[0]
            above.add(name)
    initialised = []
    with _writing_only(root, fresh) if owners else contextlib.nullcontext():
        for name, module in _post_order(root):
            initialiser = initialisers.get(name)
            if initialiser is not None:
                initialised.append(name)
                run = initialiser.run
            elif hf_parents and name in owners and name in above:
                run = partial(owners[name]._init_weights, module)
            else:
                continue
            device = next((t.device for t in _tensors(module, recurse=True) if not t.is_meta), torch.device("cpu"))
            with seeded(device, layer_seed(seed, name)), torch.no_grad():
                run()
    return initialised


def _post_order(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module of ``root``, named as ``named_modules`` names it, each after its children."""
    order: list[tuple[str, nn.Module]] = []
    seen: set[int] = set()

    def visit(name: str, module: nn.Module) -> None:
        seen.add(id(module))
        for child_name, child in module._modules.items():
            if child is not None and id(child) not in seen:
                visit(f"{name}.{child_name}" if name else child_name, child)
        order.append((name, module))

    visit("", root)
    return order


def _pretrained_owners(root: nn.Module) -> dict[str, nn.Module]:
    """For each module (by qualified name) inside a Hugging Face ``PreTrainedModel``, the innermost one around it
    (itself, if it is one): whose ``_init_weights`` initialises it, as transformers dispatches it."""
    transformers_models = sys.modules.get("transformers.modeling_utils")  # no model of it without it imported
    pretrained_class = getattr(transformers_models, "PreTrainedModel", None)
    if pretrained_class is None:
        return {}
    owners: dict[str, nn.Module] = {}
    for name, module in root.named_modules():
        if isinstance(module, pretrained_class):
            owner = module
        else:
            parent = name.rpartition(".")[0] if name else None
            owner = owners.get(parent) if parent is not None else None  # type: ignore[assignment]
        if owner is not None:
            owners[name] = owner
    return owners


@contextmanager
def _writing_only(root: nn.Module, fresh: set[int]) -> Generator[None, None, None]:
    """transformers' init functions skip a tensor marked ``_is_hf_initialized`` (how ``from_pretrained`` keeps the
    weights it loaded): every tensor of ``root`` but the ``fresh`` ones is marked meanwhile, and torch's init
    functions guarded alike, as transformers guards them while it initialises."""
    try:
        from transformers.initialization import guard_torch_init_functions
    except ImportError:  # pragma: no cover (transformers < 5: its _init_weights writes through .data)
        guard_torch_init_functions = contextlib.nullcontext
    marked = [t for t in _tensors(root, recurse=True) if id(t) not in fresh and not getattr(t, _HF_MARK, False)]
    for tensor in marked:
        setattr(tensor, _HF_MARK, True)
    try:
        with guard_torch_init_functions():
            yield
    finally:
        for tensor in marked:
            delattr(tensor, _HF_MARK)


_HF_MARK = "_is_hf_initialized"


def _checkable(tensor: Tensor) -> bool:
    """Whether a NaN in ``tensor`` can show that nothing wrote it (integer tensors hold no NaN)."""
    return tensor.is_floating_point() or tensor.is_complex()


def _check_written(fresh: list[tuple[str, nn.Module, str]], initialisers: dict[str, _Initialiser]) -> None:
    """Every allocated tensor left NaN (as `materialize` filled it) was written by no initialiser: refused by name."""
    checked = [(name, tensor_name, getattr(module, tensor_name)) for name, module, tensor_name in fresh]
    checked = [(name, tensor_name, t) for name, tensor_name, t in checked if _checkable(t) and t.numel()]
    if not checked:
        return
    unwritten = torch.stack([t.isnan().any() for _, _, t in checked]).tolist()  # one synchronisation
    left = [(name, tensor_name) for (name, tensor_name, _), nan in zip(checked, unwritten) if nan]
    if left:
        name, _ = left[0]
        tensors = [tensor_name for module_name, tensor_name in left if module_name == name]
        raise TypeError(
            f"module {name!r}: its tensors {tensors}, allocated on their stage, hold NaN after"
            f" {initialisers[name].described}: it did not write them (or wrote NaN), and they would hold whatever the"
            f" memory held. Make the initialiser fill every tensor of the module (or pass `GPipeStrategy(init_module=fn)`"
            f" with `fn(name, module)` that does; docs/memory.md), or create the module outside configure_model()."
        )


# Set on modules left on the meta device after a run because another rank holds their trained weights (see
# `mark_held_elsewhere`).
_HELD_ELSEWHERE = "_gpipe_held_elsewhere"


def _meta_parameter_holders(root: nn.Module) -> dict[int, list[tuple[nn.Module, str]]]:
    """Every meta parameter held by more than one module: ``id -> [(module, attribute), ...]``, in module order."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in root.modules():
        for attribute, parameter in module.named_parameters(recurse=False):
            if parameter.is_meta:
                holders.setdefault(id(parameter), []).append((module, attribute))
    return {key: places for key, places in holders.items() if len(places) > 1}


def _retie(holders: dict[int, list[tuple[nn.Module, str]]]) -> None:
    """``to_empty`` gives each holder of a tied parameter its own copy: make them share one again. The last
    holder's copy is kept, because with real tensors the last module to reset a shared tensor decides its values."""
    for places in holders.values():
        module, attribute = places[-1]
        kept = getattr(module, attribute)
        for other, other_attribute in places[:-1]:
            setattr(other, other_attribute, kept)


def _check_metrics(root: nn.Module) -> None:
    """torchmetrics keeps its states outside parameters and buffers: created on meta, no reset can fill them."""
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover (torchmetrics is a dependency)
        return
    for name, module in root.named_modules():
        if isinstance(module, Metric) and any(
            isinstance(state, Tensor) and state.is_meta for state in module.metric_state.values()
        ):
            raise TypeError(
                f"metric {name!r} ({type(module).__name__}) was created on the meta device, where its states have no"
                " values and reset() cannot give them any; create torchmetrics metrics in __init__, not in"
                " configure_model()."
            )


@contextmanager
def meta_tensors_left_in_place(module: nn.Module | None) -> Generator[None, None, None]:
    """Lightning's teardown moves the model to the CPU. A tensor on the meta device (a block another rank trained, or
    one never materialised because the run failed before) has no data to move: it stays where it is."""
    if module is None or not holds_meta_tensors(module):
        yield
        return
    module.cpu = lambda: module._apply(lambda t: t if t.is_meta else t.cpu())  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.cpu
