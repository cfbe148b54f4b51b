"""Where the model's code calls the pipelined blocks: each call checked, recorded and answered, a chunk run at its end.

The stand-ins of :mod:`lightning_pipe.execution.stage` hand every call of a block by the model's code here. A call
returns a placeholder computed on the meta device, with the shapes and structure of the block's real output, so the
model's code runs on as on one device, until the call of the last block of one of this stage's chunks: there
``run_chunk`` (the runtime's) runs the chunk through the pipeline, and its output, if any, goes on into the model's
code. Outside a step (a callback calling the model) the call reaching the region, and the region's end, are the
runtime's too: every stage takes part, and every stage gets the last stage's output.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_pipe.execution.batchnorm import check_micro_batches_fit_batch_norm, observed_batch_norm_inputs
from lightning_pipe.execution.call_order import (
    BlockCall,
    CallChain,
    ChunkCall,
    PipelineOrderError,
    map_tensors,
    tensors_of,
)
from lightning_pipe.execution.learned_outputs import LearnedOutputs
from lightning_pipe.execution.placeholders import Placeholders, fresh_meta, needing_gradients_as_real
from lightning_pipe.execution.stage import StageBlocks
from lightning_pipe.partition.collected_outputs import check_nothing_collected_now
from lightning_pipe.partition.hooks import hooks_set_aside
from lightning_pipe.partition.microbatch import as_tensors


class BlockCalls:
    """Answers the model's calls of the blocks of ``stage`` (routing its stand-ins here when built).

    ``run_chunk(chunk)`` runs a chunk at the call of its last block and returns its output for the model's code, or
    ``None`` (the call then answers a placeholder). Outside a step, ``begin_outside_step()`` runs when the model's call
    reaches the region, and ``share_outside_output(output)`` gives the region's output to every stage at its end.
    ``on_model_checkpoint`` is said once when the model's code calls its blocks under ``torch.utils.checkpoint``.
    """

    def __init__(
        self,
        stage: StageBlocks,
        run_chunk: Callable[[int], Any],
        begin_outside_step: Callable[[], None] = lambda: None,
        share_outside_output: Callable[[Any], Any] = lambda output: output,
        on_model_checkpoint: Callable[[], None] = lambda: None,
        learned: Callable[[BlockCalls], LearnedOutputs] | None = None,
    ) -> None:
        self.stage = stage
        self._run_chunk = run_chunk
        self._begin_outside_step = begin_outside_step
        self._share_outside_output = share_outside_output
        self._on_model_checkpoint = on_model_checkpoint
        self._said_model_checkpoints = False
        self.chain = CallChain(stage.region.names, stage.originals)
        # The outputs of blocks that cannot run on the meta device, learned from their stage (see learned_outputs).
        learned_outputs = learned(self) if learned is not None else LearnedOutputs(stage, in_step=lambda: self.in_step)
        self.placeholders = Placeholders(stage.originals, stage.running_blocks, learned_outputs)
        self.in_step = False
        self.targets: frozenset[int] = frozenset(stage.chunk_ranges)  # the chunks this call of the user's step runs
        # The frame that started this call of the user's step: a model checkpoint around a block call lies between the
        # call and that frame, so the search for one stops there (None: outside a step, the whole stack).
        self._step_frame: FrameType | None = None
        # Whether the model calls a block under its own torch.utils.checkpoint is read from the call stack, but
        # decided once per block and kind of call (model in training mode or not, gradients on or not), on the first
        # completed call of the user's step that calls it: the blocks it called outside any checkpoint then skip the
        # search (see `model_call`). Per block: a stage whose chunks separate calls run (interleaved_1f1b, zbv) sees
        # its later chunks' blocks only in the calls that run them.
        self._plain: dict[tuple[bool, bool], frozenset[int]] = {}
        self._kind: tuple[bool, bool] | None = None  # this call's kind, in a step
        self._seen_plain: set[int] | None = None  # in a step: the blocks this call learned it calls outside a checkpoint
        self._chunk_starts = {r[0]: chunk for chunk, r in stage.chunk_ranges.items() if chunk > 0}  # block -> chunk
        # The blocks whose calls only get a placeholder (they neither start nor end a chunk of this stage, nor end the
        # region): those made as the chain's plain link skip the checks (see `CallChain.chained`).
        last = len(stage.region) - 1
        self._answered_only = frozenset(range(last)) - set(self._chunk_starts) - set(stage.chunk_ends)
        stage.route(self.model_call)

    def begin_step(self, in_step: bool, targets: Iterable[int] | None = None, frame: FrameType | None = None) -> None:
        """A new call of the model's code, made from ``frame`` (when known): it runs the chunks ``targets`` (by default
        every chunk of this stage)."""
        self.in_step = in_step
        self._step_frame = frame
        self.targets = frozenset(self.stage.chunk_ranges if targets is None else targets)
        self.chain.begin()
        self._kind = (self.stage.model.training, torch.is_grad_enabled()) if in_step else None
        self._seen_plain = set() if in_step else None

    def end_step(self, completed: bool = True) -> None:
        """The user's step is over (``completed``: it ran to its end or handed off, without an error): a later call
        of the model is made outside a step. A completed call adds the blocks it called outside the model's own
        checkpoints (for the first time in its kind) to those known to be."""
        if completed and self._seen_plain and self._kind is not None:
            self._plain[self._kind] = self._plain.get(self._kind, frozenset()) | self._seen_plain
        self.in_step = False
        self._step_frame = None
        self._kind = self._seen_plain = None

    def chunk_call(self, chunk: int, detach_side_arguments: bool) -> ChunkCall:
        """What the model's code called ``chunk``'s blocks with in this call (see :meth:`CallChain.chunk_call`)."""
        return self.chain.chunk_call(chunk, self.stage.chunk_ranges[chunk], detach_side_arguments)

    def model_call(self, index: int, args: tuple, kwargs: dict) -> Any:
        """A call of block ``index`` by the model's code, through its stand-in: answered by :meth:`block_called`,
        also when the model wraps its calls in ``torch.utils.checkpoint``.

        Whether the call is made under the model's checkpoint is read from the call stack until a completed call of
        the user's step of its kind (training or not, gradients on or not) showed the block called outside any
        checkpoint; it is not searched for one again then (a reentrant checkpoint, which turns gradients off, is
        still seen): a warm step reads no stack. A model that starts checkpointing a block only later in a run is
        not supported.

        The pipeline's own re-computation takes the place of the model's checkpoint: under a non-reentrant one, the
        pipeline's tensors are saved past it (it keeps none, so it re-computes nothing); a reentrant one computes
        without gradients, so the call is computed with them and answered without. Either re-computation in backward
        then gets the first call's output back: no block runs twice for it.
        """
        kind = self._kind
        if kind is not None and index in self._plain.get(kind, ()) and torch.is_grad_enabled() == kind[1]:
            return self.block_called(index, args, kwargs)  # called outside the model's checkpoints: decided already
        phase, frame = _model_checkpoint_phase(self._step_frame)
        if phase is None:
            if self._seen_plain is not None:
                self._seen_plain.add(index)
            return self.block_called(index, args, kwargs)
        if phase in (_RECOMPUTE, _RECOMPUTE_REENTRANT):
            return self._output_again(index, reentrant=phase == _RECOMPUTE_REENTRANT)
        if not self._said_model_checkpoints:
            self._said_model_checkpoints = True
            self._on_model_checkpoint()
        if phase == _NON_REENTRANT:
            with torch.autograd.graph.saved_tensors_hooks(Tensor.detach, _same):  # innermost hooks win
                return self.block_called(index, args, kwargs)
        # Gradients where the checkpoint's backward would give them: an input of the checkpointed function needs one.
        wants_gradients = any(t.requires_grad for t in tensors_of(frame.f_locals["args"]))
        with torch.set_grad_enabled(wants_gradients):
            output = self.block_called(index, args, kwargs)
        if not any(t.requires_grad and not t.is_meta for t in tensors_of(output)):
            return output  # a placeholder (on the meta device), or a real output that needs no gradient
        call = self.chain.calls[-1]
        call.graph_output, call.output = output, map_tensors(output, Tensor.detach)
        return call.output

    def _output_again(self, index: int, reentrant: bool) -> Any:
        """The output of this step's call of block ``index`` for the model's checkpoint re-running the call in backward:
        the real one with its graph (backward goes on into the pipeline from there), a placeholder's shapes otherwise
        (as a leaf that needs a gradient where a reentrant checkpoint requires one)."""
        call = next((call for call in reversed(self.chain.calls) if call.index == index), None)
        if call is None:
            raise PipelineOrderError(
                f"torch.utils.checkpoint re-ran {self.stage.region.names[index]} in backward, but the step did not call it"
            )
        if call.graph_output is not None:
            return call.graph_output
        if not reentrant:
            return call.output
        return map_tensors(call.output, lambda t: fresh_meta(t).requires_grad_(t.is_floating_point()))

    def block_called(self, index: int, args: tuple, kwargs: dict) -> Any:
        """A call of block ``index`` by the model's code: checked, recorded, answered."""
        if index in self._answered_only:
            call = self.chain.chained(index, args, kwargs)
            if call is not None:  # most calls of a step: a block of another stage given the previous block's output
                call.output = self.placeholders.answer(index, args, kwargs)
                self.chain.record(call)
                return call.output
        if index == 0:
            check_nothing_collected_now(self.stage.num_stages)
        if index == 0 and not self.in_step:
            self.begin_step(in_step=False)
            self._begin_outside_step()
        restart, sources = self.chain.check(index, args, kwargs)
        if index in self._chunk_starts and not restart:
            # The previous chunk's output, a placeholder where another stage runs that chunk: refused here as that
            # stage refuses it, rather than with the error the block would raise on it.
            as_tensors(args[0], f"the output of model chunk {self._chunk_starts[index] - 1}")
        # NOTE: a key/value cache (Hugging Face's DynamicCache) would gather every micro-batch's keys and values, and
        # the placeholders' meta-device ones: training needs none, so the pipelined blocks get none.
        args, kwargs = _without_caches(args), _without_caches(kwargs)
        carried = tuple(key for key in sources.values() if key[0] < self.chain.segment_start)
        call = BlockCall(index, args, kwargs, restart=restart, carried=carried, sources=sources)
        self.chain.calls.append(call)
        output = placeholder = None
        chunk = self.stage.chunk_ends.get(index)
        if chunk is not None and chunk in self.targets:
            placeholder = self.placeholders.share(index, args, kwargs)
            output = self._run_chunk(chunk)
        if output is not None:
            call.output = output
        elif placeholder is not None:  # computed for the stages that learn it from here
            call.output = needing_gradients_as_real(placeholder, self.stage.originals[index], args, kwargs)
        else:
            call.output = self.placeholders.answer(index, args, kwargs)
        if index == len(self.stage.region) - 1 and not self.in_step:
            call.output = self._share_outside_output(output)
        self.chain.record(call)
        return call.output

    def check_micro_batches_fit_batch_norm(
        self,
        chunk_call: ChunkCall,
        num_micro_batches: int,
        epoch_last_batch: int | None = None,
        batch_size: int | None = None,
    ) -> None:
        """Raise before the chunk runs if a micro-batch is too small for one of its BatchNorms in training, in this
        step (a batch of ``batch_size``, by default the call's) or in the epoch's smaller ``epoch_last_batch``: the
        shapes each BatchNorm sees come from this call of the chunk's blocks, re-run on the meta device."""
        stage = self.stage
        blocks = [stage.originals[call.index] for call in chunk_call.calls]
        if not any(isinstance(module, _BatchNorm) for block in blocks for module in block.modules()):
            return
        # The observers are registered once the user's hooks are set aside (the placeholders would set them aside too).
        with hooks_set_aside(stage.modules()), observed_batch_norm_inputs(stage.model, chunk_call.batch) as values:
            for call in chunk_call.calls:
                self.placeholders.output(call.index, call.args, call.kwargs, reuse=False)  # the hooks must see the shapes
        batch_size = batch_size or chunk_call.batch
        check_micro_batches_fit_batch_norm(stage.model, values, batch_size, num_micro_batches)
        if epoch_last_batch is not None:
            check_micro_batches_fit_batch_norm(stage.model, values, epoch_last_batch, num_micro_batches, True)


# Where a block call made by the model's code stands in torch.utils.checkpoint (see `BlockCalls.model_call`).
_NON_REENTRANT, _REENTRANT, _RECOMPUTE, _RECOMPUTE_REENTRANT = "non-reentrant", "reentrant", "recompute", "recompute reentrant"
_CHECKPOINT_SOURCE = torch_checkpoint.__file__
_REENTRANT_FORWARD = torch_checkpoint.CheckpointFunction.forward.__code__
_REENTRANT_BACKWARD = torch_checkpoint.CheckpointFunction.backward.__code__


def _model_checkpoint_phase(stop: FrameType | None = None) -> tuple[str | None, FrameType | None]:
    """The innermost ``torch.utils.checkpoint`` phase that the current call is made in, read from the call stack up
    to the frame ``stop`` (the user's step, below which no model checkpoint lies), with its frame: a reentrant
    checkpoint's forward, a non-reentrant one's, either's re-computation in backward; ``None`` outside."""
    frame = sys._getframe(2)
    while frame is not None and frame is not stop:
        code = frame.f_code
        if code.co_filename == _CHECKPOINT_SOURCE:
            if code is _REENTRANT_FORWARD:
                return _REENTRANT, frame
            if code is _REENTRANT_BACKWARD:
                return _RECOMPUTE_REENTRANT, frame
            if code.co_name == "recompute_fn":
                return _RECOMPUTE, frame
            if code.co_name == "checkpoint":
                return _NON_REENTRANT, frame
        frame = frame.f_back
    return None, None


def _same(value: Any) -> Any:
    return value


def _is_cache(value: Any) -> bool:
    """A Hugging Face key/value cache (``transformers.cache_utils.Cache`` and its subclasses)."""
    return _is_cache_type(type(value))


@functools.cache
def _is_cache_type(kind: type) -> bool:  # asked for every argument of every block call: once per type
    return any(cls.__name__ == "Cache" and cls.__module__.startswith("transformers") for cls in kind.__mro__)


def _no_cache(value: Any) -> Any:
    return None if _is_cache(value) else value


def _without_caches(values: Any) -> Any:
    """A call's arguments (a tuple, or a dict of keywords) with every key/value cache replaced by ``None``; the same
    object when none is one (the common case, checked once per type)."""
    items = values.values() if isinstance(values, dict) else values
    if not any(_is_cache_type(type(value)) for value in items):
        return values
    if isinstance(values, dict):
        return {key: _no_cache(value) for key, value in values.items()}
    return tuple(_no_cache(value) for value in values)
