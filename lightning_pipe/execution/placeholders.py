"""A block's output computed on the meta device (or learned from its stage): what the model's code gets for a block
that runs elsewhere or later."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_pipe.execution.call_order import map_tensors, tensors_of
from lightning_pipe.execution.learned_outputs import LearnedOutputs
from lightning_pipe.partition.hooks import hooks_set_aside
from lightning_pipe.partition.meta_run import uncompiled

SIGNATURES_KEPT = 8
_ANSWERS_KEPT = 1024  # tensors of answers whose signature is known by their id (see `Placeholders.answer`)
_PLAIN = (bool, int, float, str, torch.dtype, torch.device, type(None))


class Placeholders:
    """The meta-device outputs of the region's blocks (``originals``), each block run there once per input signature.

    ``running_blocks`` is the stage's context in which a block's call runs the block itself, not its stand-in;
    ``learned`` gives the outputs of blocks that cannot run on the meta device, from the stage holding each
    (without it, such a block's error is raised).
    """

    def __init__(
        self,
        originals: list[nn.Module],
        running_blocks: Callable[[], contextlib.AbstractContextManager],
        learned: LearnedOutputs | None = None,
    ) -> None:
        self.originals = originals
        self._running_blocks = running_blocks
        self.learned = learned  # the outputs of blocks that cannot run on the meta device, from their stage
        self._meta_states: dict[int, dict[str, Tensor]] = {}
        self._meta_outputs: dict[int, dict[Hashable, _Known]] = {}  # per block: its meta output, by input signature
        # The answers' tensors, by id: (the tensor, its signature). The next block's call takes them: its signature is
        # then known without asking each tensor its shape and strides (which costs microseconds). Held here, an
        # answer's id cannot pass to another tensor.
        self._answered: dict[int, tuple[Tensor, Hashable]] = {}

    def answer(self, index: int, args: tuple, kwargs: dict) -> Any:
        """What the model's call of block ``index`` gets where the block does not run now: its :meth:`output`,
        needing gradients where the real output would (:func:`wants_gradients`).

        A repeated input signature gets the same tensors as the last call: meta tensors hold no values, so only an
        in-place change of their shape or strides (which bumps their version) could change what they say, and such an
        answer is made anew. The stages' placeholders, made once per micro-batch, then cost a lookup (a meta tensor
        costs 10-20 us to make)."""
        block = self.originals[index]
        answered = self._answered
        if not kwargs and len(args) == 1 and type(args[0]) is Tensor:  # the chain's call: `_signature_of_call`'s key
            arg = args[0]
            known = answered.get(id(arg))
            key: Hashable | None = (block.training, known[1] if known is not None and known[0] is arg else
                                    (arg.shape, arg.stride(), arg.dtype))
        else:
            key = _signature_of_call(block.training, args, kwargs)
        gradients = wants_gradients(block, args, kwargs)
        outputs = self._meta_outputs.get(index)
        found = outputs.get(key) if outputs is not None and key is not None else None
        if found is None:
            output = self.output(index, args, kwargs)
            found = self._meta_outputs[index].get(key) if key is not None else None
            if found is None:  # not kept (its signature holds something else than tensors and plain values)
                return _needing_gradients(output) if gradients else output
        if torch.is_inference_mode_enabled():  # inference tensors keep no version to check: made anew (evaluation)
            return found.answer(gradients)
        made = found.answers.get(gradients)
        if made is None or any(tensor._version for tensor in made[1]):  # new, or changed in place (`x.unsqueeze_(0)`)
            answer = found.answer(gradients)
            made = found.answers[gradients] = (answer, tensors_of(answer))
            if len(answered) >= _ANSWERS_KEPT:
                answered.clear()
            for tensor in made[1]:
                answered[id(tensor)] = (tensor, signature(tensor))
        return made[0]

    def output(self, index: int, args: tuple, kwargs: dict, reuse: bool = True) -> Any:
        """The block's output on the meta device: its structure and shapes, without its cost.

        The block runs there once per input signature (training mode, the arguments' shapes, strides and dtypes,
        their plain values); later calls with the same signature get fresh meta tensors shaped as that output. An
        argument or output that holds anything else (an object, a named tuple) makes the block run every time. A
        block whose code cannot run there (it depends on values) gets its output from the stage that holds it
        (:mod:`lightning_pipe.execution.learned_outputs`), as often. ``reuse=False``: computed anew, sent to no one.
        """
        block = self.originals[index]
        known = self._meta_outputs.setdefault(index, {})
        key = _signature_of_call(block.training, args, kwargs) if reuse else None
        if key is not None and key in known:
            return map_tensors(known[key].output, fresh_meta)
        output = self._computed(index, args, kwargs, send=reuse)
        if key is not None and signature(output) is not None:
            if len(known) >= SIGNATURES_KEPT:
                known.clear()  # signatures that change every step (a growing sequence) must not pile up
            known[key] = _Known(map_tensors(output, fresh_meta))
        return output

    def share(self, index: int, args: tuple, kwargs: dict) -> Any:
        """On the stage holding block ``index``, at a call that runs it for real (the last block of a chunk): the
        stages that call it without holding it get its output from here if it cannot run on the meta device. The
        placeholder, if one was computed for them (``None`` otherwise)."""
        if self.learned is not None and self.learned.receivers(index):
            return self.output(index, args, kwargs)
        return None

    def _computed(self, index: int, args: tuple, kwargs: dict, send: bool) -> Any:
        # NOTE: the meta device is tried for every new input signature, also after a failure: every stage calling
        # the block decides alike whether its holder sends the output, with no message about it.
        learned = self.learned
        block = self.originals[index]
        if index not in self._meta_states:
            self._meta_states[index] = {
                name: _meta_copy(t) for name, t in _state(block).items()
            }
        try:
            # No user hook sees meta tensors; compiled code runs as plain Python, never compiled for the meta device.
            with self._running_blocks(), torch.no_grad(), hooks_set_aside(block.modules()), uncompiled():
                return torch.func.functional_call(
                    block, self._meta_states[index], map_tensors(args, _to_meta), map_tensors(kwargs, _to_meta),
                    strict=False,
                )
        except Exception as error:  # code that depends on values (a mixture of experts' routing)
            if learned is None:
                raise
            learned.cannot_run_on_meta(index, error)
            return learned.output(index, args, kwargs, send)


def needing_gradients_as_real(output: Any, module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """``output``, what a stand-in answers for a call of ``module`` that runs elsewhere, with its floating-point
    tensors needing a gradient where the real output would: gradients on, and the module trainable or an input
    needing one.

    Code after the call can tell: a reentrant ``torch.utils.checkpoint`` around a later block computes with
    gradients only if one of its inputs needs one, so an answer that needs none would cut this stage's graph there,
    and its backward would never send the gradient the stage before waits for.
    """
    return _needing_gradients(output) if wants_gradients(module, args, kwargs) else output


def wants_gradients(module: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether the real output of ``module``'s call with ``args`` and ``kwargs`` would need a gradient: gradients on,
    and an input needing one or the module trainable."""
    if not torch.is_grad_enabled():
        return False
    # The inputs first: in a training step the previous block's answer needs a gradient already, and walking the
    # module's parameters is the costlier test (it walks every submodule), made only when no input needs one.
    if not kwargs and len(args) == 1 and type(args[0]) is Tensor:  # the chain's call: the previous block's output
        if args[0].requires_grad:
            return True
    elif any(t.requires_grad for t in tensors_of((args, kwargs))):
        return True
    return any(p.requires_grad for p in module.parameters())


def _needing_gradients(output: Any) -> Any:
    """``output`` with its floating-point leaves needing a gradient (in place)."""
    return map_tensors(output, lambda t: t.requires_grad_() if t.is_leaf and t.is_floating_point() else t)


class _Known:
    """A block's meta output for one input signature, and the answers made of it (:meth:`Placeholders.answer`): one
    that needs no gradient and one that does, each made at its first use."""

    __slots__ = ("output", "answers")

    def __init__(self, output: Any) -> None:
        self.output = output
        self.answers: dict[bool, tuple[Any, list[Tensor]]] = {}  # by whether it needs gradients: (answer, its tensors)

    def answer(self, gradients: bool) -> Any:
        answer = map_tensors(self.output, fresh_meta)
        return _needing_gradients(answer) if gradients else answer


def fresh_meta(tensor: Tensor) -> Tensor:
    """A new meta tensor with ``tensor``'s shape, strides and dtype."""
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")


def _to_meta(tensor: Tensor) -> Tensor:
    return tensor if tensor.is_meta else tensor.to("meta")


def _signature_of_call(training: bool, args: tuple, kwargs: dict) -> Hashable | None:
    """:func:`signature` of a block call; for the common call on tensors alone, a flat key of their shapes, strides and
    dtypes (which no nested signature equals: it starts with a bool)."""
    if not kwargs and all(type(arg) is Tensor for arg in args):
        return (training, *[(arg.shape, arg.stride(), arg.dtype) for arg in args])
    return signature((training, args, kwargs))


def signature(value: Any) -> Hashable | None:
    """What a block's meta output can depend on in ``value``, as a hashable key: each tensor's shape, strides and
    dtype, plain values as they are, containers as ``map_tensors`` walks them; ``None`` if ``value`` holds anything
    else."""
    if isinstance(value, Tensor):
        return (value.shape, value.stride(), value.dtype)  # torch.Size is a tuple: hashable as it is
    if isinstance(value, _PLAIN):
        return (type(value).__name__, value)
    if (isinstance(value, (tuple, list)) and not hasattr(value, "_fields")) or type(value) is dict:
        keys = []
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            found = signature(item)
            if found is None:
                return None
            keys.append((key, found))
        return (type(value).__name__, tuple(keys))
    return None


def _meta_copy(tensor: Tensor) -> Tensor:
    """``tensor`` on the meta device; a block sharded over its replicas (a DTensor: lightning_pipe.execution.sharding)
    by its whole shape."""
    if isinstance(tensor, DTensor):
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
    return torch.empty_like(tensor, device="meta")


def _state(block: nn.Module) -> dict[str, Tensor]:
    return {**dict(block.named_parameters()), **dict(block.named_buffers())}
