"""Deferred construction: a model built on the meta device becomes real, initialised tensors where it runs.

A model built in ``LightningModule.configure_model()`` (or under ``trainer.init_module(empty_init=True)``) under the
gpipe strategy has only shapes: its tensors live on the meta device and take no memory. Once the strategy knows
which layers are this rank's, :func:`materialize` allocates exactly those on the stage's device and initialises
them; the other stages' layers never take memory here.

Initial weights must not depend on how the model is split, so that runs on 1, 2 or 4 stages start alike. The rule:
every module that holds parameters or buffers of its own is initialised by its ``reset_parameters()``, with the
random generators seeded by :func:`layer_seed` from the global seed and the module's qualified name in the
LightningModule (``"net.model.5"``). The name, unlike the order of construction or the stage, is the same whatever
the split. :func:`init_weights` applies the same rule to a model built with real tensors, which is how a run
without this strategy (one device, ``strategy="auto"``) starts from the same weights.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Collection, Generator, Iterator
from contextlib import contextmanager

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


def materialize(root: nn.Module, device: torch.device, seed: int, filled: Collection[str] = ()) -> list[str]:
    """Allocate every meta tensor of ``root`` on ``device`` and initialise it by the rule in this module's docstring.

    ``root`` is the LightningModule after the strategy replaced the pipelined ``nn.Sequential`` by this rank's stage,
    so what is left on meta is exactly what this rank needs: its stage's layers and the replicated modules outside
    the pipeline. Tensors already real are left alone. Parameters tied between modules stay tied. ``filled``: the
    names (state-dict keys, ``"blocks.3.weight"``) of tensors the caller fills next from pretrained weights; they
    are allocated and not initialised, so a module all of whose meta tensors are filled needs no initialiser, and a
    module whose parameters are filled but whose buffers are not (rotary frequencies, computed when the model is
    built) may have them filled by its Hugging Face model's ``_init_weights``, as ``from_pretrained`` fills them.
    Returns the qualified names of the modules it initialised, in order.
    """
    holders = _meta_parameter_holders(root)
    initialised = []
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
        unfilled = {n for n, t in _named_tensors(module) if t.is_meta and f"{prefix}{n}" not in filled}
        buffers_only = bool(filled) and not unfilled & {n for n, _ in module.named_parameters(recurse=False)}
        initialise = _initialiser(root, name, module, buffers_only) if unfilled else None
        module.to_empty(device=device, recurse=False)
        if initialise is not None:
            with seeded(device, layer_seed(seed, name)):
                initialise()
            initialised.append(name)
    _retie(holders)
    _check_metrics(root)
    return initialised


def init_weights(module: nn.Module, seed: int | None = None) -> list[str]:
    """Initialise ``module``'s weights by the stage-count-independent rule, as the gpipe strategy does on its own.

    Call it with the LightningModule at the end of ``configure_model()`` to start a run without the gpipe strategy
    (one device) from the weights a pipeline of any length starts from::

        def configure_model(self):
            if self.blocks is not None:  # configure_model runs again for trainer.test/validate/predict
                return
            self.blocks = nn.Sequential(*[Block(d) for _ in range(n)])
            lightning_pipe.init_weights(self)

    Every module holding parameters or buffers of its own and a ``reset_parameters()`` is reset, with the random
    generators of its tensors' device seeded by ``layer_seed(seed, name)`` (``name`` relative to ``module``, so pass
    the LightningModule); the global random state is left as it was. Modules without ``reset_parameters()`` keep the
    values they were built with. Tensors still on the meta device (under the gpipe strategy) are skipped: the
    strategy initialises them by the same rule when it materialises them on their stage. ``seed`` defaults to
    :func:`global_seed`. Returns the qualified names of the modules it reset.
    """
    seed = global_seed() if seed is None else seed
    reset = []
    for name, submodule in module.named_modules():
        own = list(_tensors(submodule, recurse=False))
        if not own or any(t.is_meta for t in own) or not callable(getattr(submodule, "reset_parameters", None)):
            continue
        with seeded(own[0].device, layer_seed(seed, name)):
            submodule.reset_parameters()
        reset.append(name)
    return reset


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


def _initialiser(root: nn.Module, name: str, module: nn.Module, buffers_only: bool) -> Callable[[], None]:
    """What fills ``module``'s tensors: its ``reset_parameters()``; when only buffers are left to fill (the
    parameters come from pretrained weights), the ``_init_weights(module)`` of the Hugging Face model around it,
    which computes buffers such as rotary frequencies; else a ``TypeError`` naming the fix."""
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        return reset
    if buffers_only:
        parts = name.split(".")
        for depth in range(len(parts) - 1, -1, -1):  # the innermost enclosing model first
            owner = root.get_submodule(".".join(parts[:depth]))
            if callable(getattr(owner, "_init_weights", None)):
                return lambda: owner._init_weights(module)
    tensors = [tensor_name for tensor_name, _ in _named_tensors(module)]
    raise TypeError(
        f"module {name or '(the LightningModule)'!r} ({type(module).__name__}) holds tensors {tensors} on the meta"
        " device but has no reset_parameters() to initialise them after they are allocated on their stage;"
        f" define `{type(module).__name__}.reset_parameters(self)` that fills them (as nn.Linear's does), or"
        " create them outside configure_model()."
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
    """Lightning's teardown moves the model to the CPU. A tensor on the meta device (a layer another rank trained, or
    one never materialised because the run failed before) has no data to move: it stays where it is."""
    if module is None or not holds_meta_tensors(module):
        yield
        return
    module.cpu = lambda: module._apply(lambda t: t if t.is_meta else t.cpu())  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module.cpu
