"""A function of a model run on the meta device: no memory, no values, the model's attributes as they were after.

What the partition observes without running anything for real goes through :func:`run_on_meta`: which modules a
step calls in which order (:mod:`lightning_pipe.partition.region`), where the outside modules' outputs go
(:mod:`lightning_pipe.partition.placement`), and the bytes autograd saves for each block
(:mod:`lightning_pipe.partition.memory_estimate`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


def run_on_meta(
    model: nn.Module, calling: Callable[[nn.Module], Any], extra_modes: Sequence[TorchDispatchMode] = (),
    gradients: bool = False, errors: list[Exception] | None = None,
) -> Any:
    """``calling(model)`` on the meta device, without gradients (with them, ``gradients``: autograd records the graph
    and saves what backward would need, still taking no memory): no memory, the model's attributes as they were
    after, ``extra_modes`` entered around it. Its output, or ``None`` when it fails part-way (code that cannot run on
    the meta device; the error appended to ``errors``): what observers saw until then still counts. The caller sets
    the user's hooks aside (:func:`~lightning_pipe.partition.hooks.hooks_set_aside`) before registering its own."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(uncompiled())
        stack.enter_context(attributes_kept(model))
        stack.enter_context(_MetaScalars())
        for mode in extra_modes:
            stack.enter_context(mode)
        # Each tensor once (a tied weight under one of its names), buffers the state dict leaves out too.
        state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
        meta_state = {
            f"model.{name}": torch.empty_like(t, device="meta").requires_grad_(gradients and t.requires_grad)
            for name, t in state.items()
        }
        try:
            with torch.set_grad_enabled(gradients):
                return torch.func.functional_call(_Calling(model, calling), meta_state, (), strict=False)
        except Exception as error:
            if errors is not None:
                errors.append(error)
            return None


def uncompiled() -> contextlib.AbstractContextManager:
    """While open, compiled code (``torch.compile(module)``, ``module.compile()``) runs as plain Python: for runs on
    the meta device, which need shapes only.

    A compiled module first called under a ``TorchDispatchMode`` (the meta runs' modes) is not compiled, and torch
    marks its code to be skipped for good: the block would then run uncompiled in every step of the run."""
    return torch.compiler.set_stance("force_eager")


@contextlib.contextmanager
def blocks_answered_when_they_fail(blocks: Sequence[nn.Module], failures: list[str]) -> Iterator[None]:
    """While open, a block whose code fails on the meta device (code that depends on values: a mixture of experts'
    routing) returns new meta tensors shaped as its first argument, as a residual block's output is, instead of
    raising; each failure's block and error in ``failures``. Enough to follow a step past its blocks (where the
    values around them go), never to compute with: a stage learns the real shapes from the block's stage."""
    def answering(block: nn.Module, forward: Callable[..., Any]) -> Callable[..., Any]:
        def answered(*args: Any, **kwargs: Any) -> Any:
            try:
                return forward(*args, **kwargs)
            except Exception as error:
                if not args:
                    raise
                failures.append(f"{type(block).__name__}: {type(error).__name__}: {_first_line(error)}")
                return _like(args[0])
        return answered

    own = [block.__dict__.get("forward") for block in blocks]
    for block, forward in zip(blocks, own):
        block.forward = answering(block, forward or type(block).forward.__get__(block))  # type: ignore[method-assign]
    try:
        yield
    finally:
        for block, forward in zip(blocks, own):
            if forward is None:
                block.__dict__.pop("forward", None)
            else:
                block.forward = forward  # type: ignore[method-assign]


def _like(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value, device="meta")
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return type(value)(_like(item) for item in value)
    return value


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else ""


class _MetaScalars(TorchDispatchMode):
    """A meta tensor read as a Python number answers 1 (``True``): models read masks' values on their way to the blocks
    (Hugging Face's ``padding_mask.all()``, ``nn.TransformerDecoder``'s causal-mask test), which the meta device
    cannot answer. Only which modules the run calls, with what, matters here, not the path such a value picks."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            return torch.ones((), dtype=args[0].dtype).item()
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def attributes_kept(model: nn.Module) -> Iterator[None]:
    """Every module of ``model`` keeps the attributes it had: what code run inside sets or adds is undone."""
    saved = [(module, dict(module.__dict__)) for module in model.modules()]
    try:
        yield
    finally:
        for module, attributes in saved:
            for added in set(module.__dict__) - set(attributes):
                del module.__dict__[added]
            module.__dict__.update(attributes)


class _Calling(nn.Module):
    """``calling(model)`` as a module's forward, so that ``torch.func.functional_call`` runs it on the meta state."""

    def __init__(self, model: nn.Module, calling: Callable[[nn.Module], Any]) -> None:
        super().__init__()
        self.model = model
        self.calling = calling

    def forward(self) -> Any:
        return self.calling(self.model)
