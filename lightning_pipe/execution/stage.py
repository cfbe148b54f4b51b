"""This rank's blocks of the pipelined region, and the stand-ins through which the model's own code calls them.

The model keeps its code: its ``nn.Sequential`` still runs its children in order, its loop still calls
``h = block(h, mask, ...)``. At set-up every block of the region is reached through a stand-in:

* a block of another stage is replaced by a :class:`RemoteBlock` (no parameters here);
* a block of this stage stays where it is (its state-dict keys do not change); its ``forward`` is routed here.

During a step every call is observed, in order, and checked: its first argument must be the previous block's output
(or that output's first item), or an input the model's code computed from the batch: the chain restarts there, as an
encoder-decoder's decoder starts from the embedded target. Besides the previous block's output, a block may take the
output of a block before the chain's last restart (the decoder's blocks take the encoder's output): that output is
carried along with the hidden state to every later stage (see :class:`ChunkCall`), and its gradient back; so are the
other items of a stage's last output (T5's blocks pass their position bias on). Any other earlier output (a skip past
the next block) is refused. A call returns a placeholder computed on the meta device, with the shapes and structure of
the block's real output, so the model's code runs on as on one device, until the call of the last block of one of
this stage's chunks (a stage holds one contiguous chunk of blocks, or several with virtual stages): there the pipeline
runs that chunk (``on_chunk_end``, the runtime's). :meth:`StageBlocks.chunk_call` keeps what the chunk's blocks were called with,
and :meth:`StageBlocks.run_micro_batch` runs them on a micro-batch with each block's own arguments, split along the
batch dimension where they have it.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from types import FrameType
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_pipe.execution.batchnorm import check_micro_batches_fit_batch_norm, observed_batch_norm_inputs
from lightning_pipe.partition.hooks import hooks_set_aside
from lightning_pipe.partition.microbatch import Activation
from lightning_pipe.partition.region import Region, first_item


class PipelineOrderError(RuntimeError):
    """The model's code does not call the pipelined blocks as a chain."""


ChainKey = tuple[int, "int | None"]  # a block's output (index, None) or one of its items (index, item)


@dataclass(frozen=True)
class _ChainValue:
    """In a chunk's recorded call: an argument that is an earlier block's output, taken from the chain when the
    chunk runs (received with the activation, or computed by a block of the chunk)."""

    key: ChainKey


@dataclass
class _Call:
    """One observed call of a block in the current step."""

    index: int
    args: tuple
    kwargs: dict
    output: Any = None  # what the call returned to the model's code
    restart: bool = False  # its first argument comes from the model's code, not from the block before
    carried: tuple[ChainKey, ...] = ()  # the outputs of blocks before the chain's last restart that it takes
    sources: dict[int, ChainKey] = field(default_factory=dict)  # id of an argument -> the earlier output it is
    # The output with its autograd graph, where the model's code got it without (a reentrant checkpoint's forward):
    # what the checkpoint's re-computation in backward gets.
    graph_output: Any = None


@dataclass
class ChunkCall:
    """What the model's code called one chunk's blocks with, in one call of the user's step: all the engine needs to
    run the chunk on a micro-batch, then or later (a re-computation in backward, a later tick of the schedule)."""

    chunk: int
    calls: list[_Call]
    batch: int  # the batch size of the chunk's input in this call
    # The earlier blocks' outputs that the chunk's output message carries on: each one that any block up to the chunk's
    # end took from before its chain's restart (a decoder's blocks take the encoder's output). Known from the calls
    # made so far: a value carried once travels on to the end of the region.
    carried: tuple[ChainKey, ...] = ()
    input_key: ChainKey | None = None  # which output of the block before the chunk travels into it
    # Side arguments that need a gradient, as leaves: id(user tensor) -> (it, its leaf). Each micro-batch's backward
    # stops there; their gradients are carried into the model's code once every micro-batch of the call is done.
    leaves: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)

    @property
    def stage_input(self) -> Any:
        """The chunk's input: the first argument of its first block's call."""
        return self.calls[0].args[0]

    def side_gradients(self) -> list[tuple[Tensor, Tensor]]:
        """(side argument, its gradient over the call's micro-batches) for the model's own graph."""
        return [(original, leaf.grad) for original, leaf in self.leaves.values() if leaf.grad is not None]

    def describe(self, names: Sequence[str]) -> str:
        """Its blocks by name (``names``: the region's), as errors name them."""
        first, last = names[self.calls[0].index], names[self.calls[-1].index]
        return first if first == last else f"{first} .. {last}"


class RemoteBlock(nn.Module):
    """Stands where a block of another stage was; its call returns a placeholder of that block's output."""

    def __init__(self, index: int, name: str, stage: StageBlocks) -> None:
        super().__init__()
        self.index = index
        self.block_name = name
        object.__setattr__(self, "_stage", stage)  # not a submodule: no parameters, no state

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Not through nn.Module's call: hooks on a stand-in never fire, for the block runs on another rank.
        return self._stage.model_call(self.index, args, kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._stage.model_call(self.index, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        """The original block's attribute, for code that reads one (``nn.TransformerEncoder`` reads
        ``layers[0].self_attn.batch_first``); not its own parameters and buffers, which another stage holds."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "_stage":
                raise
            original = self._stage.originals[self.index]
            if name in original._parameters or name in original._buffers:
                raise AttributeError(f"{self.block_name}.{name} is held by another pipeline stage") from None
            return getattr(original, name)

    def extra_repr(self) -> str:
        return f"{self.block_name}, on another pipeline stage"


class StageBlocks:
    """The blocks of ``model`` held by this rank, as one pipeline stage: ``local`` is their range of indices into
    ``region``, or with virtual stages a mapping from each of this stage's chunks (numbered along the model, of
    ``num_chunks``) to its range."""

    def __init__(
        self,
        model: nn.Module,
        region: Region,
        local: range | Mapping[int, range],
        stage_index: int,
        num_stages: int,
        unsplit_arguments: Sequence[str] = (),
        num_chunks: int | None = None,
    ) -> None:
        self.model = model
        self.region = region
        self.chunk_ranges = dict(local) if isinstance(local, Mapping) else {stage_index: local}
        self.indices = sorted(i for chunk_range in self.chunk_ranges.values() for i in chunk_range)
        self.num_chunks = num_chunks if num_chunks is not None else num_stages
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.unsplit_arguments = frozenset(unsplit_arguments)
        self.originals = region.blocks(model)  # every block as the user built it (the remote ones are not used)
        self.blocks = [self.originals[i] for i in self.indices]
        self._chunk_ends = {chunk_range[-1]: chunk for chunk, chunk_range in self.chunk_ranges.items()}
        # Set by the runtime. At the last block of a chunk this call runs (see `begin_step`): run the chunk; the
        # chunk's real output if the model's code should go on with it, else None (the block answers a placeholder),
        # unless the runtime ends the user's step there. Outside a step (a callback calling the model): when the
        # model's call reaches the region, and at the region's end, where every stage gets the last stage's output.
        self.on_chunk_end: Callable[[int], Any] | None = None
        self.on_outside_step_start: Callable[[], None] | None = None
        self.outside_step_output: Callable[[Any], Any] | None = None
        # Set by the strategy: said once when the model's code calls its blocks under torch.utils.checkpoint.
        self.on_model_checkpoint: Callable[[], None] | None = None
        self._said_model_checkpoints = False
        self.in_step = False
        self.targets: frozenset[int] = frozenset(self.chunk_ranges)  # the chunks this call of the user's step runs
        self._executing = False  # the engine runs real blocks: their forward goes straight through
        self._calls: list[_Call] = []
        self._producers: dict[int, ChainKey] = {}  # id of a block output (or item) in this step -> where it came from
        self._segment_start = 0  # the index of the block where the chain last restarted
        self._takes_first_item: bool | None = None  # the model passes output[0], not the output, to the next block
        self._meta_states: dict[int, dict[str, Tensor]] = {}
        self._meta_outputs: dict[int, dict[Hashable, Any]] = {}  # per block: its meta output, by input signature
        self._argument_names_of: dict[int, list[str] | None] = {}
        self._nested_tensor_setting: tuple[nn.TransformerEncoder, bool] | None = None
        # Compiled calls of local blocks, run on micro-batches (a block compiled in place, or by `compile_stage`):
        # the model's own call of a block must reach the routing uncompiled, for it drives the pipeline.
        self.compiled_calls: dict[int, Callable[..., Any]] = {}
        self._compiled_in_place: set[int] = set()
        self._undo: list[Callable[[], None]] = []

    # ---- installing the stand-ins --------------------------------------------------------------------------------

    def install(self) -> None:
        """Put the stand-ins into the model: remote blocks replaced, local blocks' ``forward`` routed here."""
        self._nested_tensor_setting = _avoid_nested_tensors(self.model, self.region)
        for index, (name, block) in enumerate(zip(self.region.names, self.originals)):
            if index in self.indices:
                block.forward = self._routed(index, block)  # type: ignore[method-assign]
                if getattr(block, "_compiled_call_impl", None) is not None:  # `block.compile()`
                    self.compiled_calls[index], block._compiled_call_impl = block._compiled_call_impl, None
                    self._compiled_in_place.add(index)
                block._compiled_call_impl = self._routed_call(index, block)
            else:
                _replace_submodule(self.model, name, RemoteBlock(index, name, self))

    def uninstall(self) -> None:
        """Put every original block back (with their weights as they are), and their own ``forward``."""
        if self._nested_tensor_setting is not None:
            encoder, use_nested_tensor = self._nested_tensor_setting
            encoder.use_nested_tensor = use_nested_tensor
        for undo in reversed(self._undo):
            undo()
        self._undo = []
        for index, (name, block) in enumerate(zip(self.region.names, self.originals)):
            if index in self.indices:
                block.__dict__.pop("forward", None)
                block._compiled_call_impl = self.compiled_calls[index] if index in self._compiled_in_place else None
            else:
                _replace_submodule(self.model, name, block)

    @contextlib.contextmanager
    def showing_whole_model(self) -> Iterator[None]:
        """While open, the model holds every original block again, for code that reads the model as it was built
        (Lightning's model summary): another stage's block is still not run here, its calls answered as its
        stand-in's are."""
        stand_ins = {}
        for index, name in enumerate(self.region.names):
            if index not in self.indices:
                stand_ins[index] = self.model.get_submodule(name)
                original = self.originals[index]
                original._compiled_call_impl = self._routed_call(index, original)  # its placeholder still runs it
                _replace_submodule(self.model, name, original)
        try:
            yield
        finally:
            for index, stand_in in stand_ins.items():
                self.originals[index]._compiled_call_impl = None
                _replace_submodule(self.model, self.region.names[index], stand_in)

    def on_uninstall(self, undo: Callable[[], None]) -> None:
        """Run ``undo`` when the original blocks are put back (after the run)."""
        self._undo.append(undo)

    def _routed(self, index: int, block: nn.Module) -> Callable[..., Any]:
        own = block.__dict__.get("forward")  # a forward set on the instance (e.g. by another library) stays its

        def forward(*args: Any, **kwargs: Any) -> Any:
            if self._executing:  # looked up at call time: the class may change (deferred BatchNorm)
                return (own or type(block).forward.__get__(block))(*args, **kwargs)
            return self.model_call(index, args, kwargs)

        return forward

    def _routed_call(self, index: int, block: nn.Module) -> Callable[..., Any]:
        """What ``block(...)`` runs (nn.Module's ``_compiled_call_impl``): the model's call is answered here without the
        block's hooks and the global module hooks, which fire when the block runs on a micro-batch."""

        def call(*args: Any, **kwargs: Any) -> Any:
            if self._executing:
                return block._call_impl(*args, **kwargs)
            return self.model_call(index, args, kwargs)

        return call

    def modules(self) -> Iterator[nn.Module]:
        for block in self.blocks:
            yield from block.modules()

    def parameters(self) -> Iterator[nn.Parameter]:
        for block in self.blocks:
            yield from block.parameters()

    def buffers(self) -> Iterator[Tensor]:
        for block in self.blocks:
            yield from block.buffers()

    # ---- the model's calls ---------------------------------------------------------------------------------------

    def begin_step(self, in_step: bool, targets: Iterator[int] | None = None) -> None:
        """A new call of the model's code: it runs the chunks ``targets`` (by default every chunk of this stage)."""
        self.in_step = in_step
        self.targets = frozenset(self.chunk_ranges if targets is None else targets)
        self._calls = []
        self._producers = {}
        self._segment_start = 0

    def model_call(self, index: int, args: tuple, kwargs: dict) -> Any:
        """A call of block ``index`` by the model's code, through its stand-in: answered by :meth:`block_called`,
        also when the model wraps its calls in ``torch.utils.checkpoint``.

        The pipeline's own re-computation takes the place of the model's checkpoint: under a non-reentrant one, the
        pipeline's tensors are saved past it (it keeps none, so it re-computes nothing); a reentrant one computes
        without gradients, so the call is computed with them and answered without. Either re-computation in backward
        then gets the first call's output back: no block runs twice for it.
        """
        phase, frame = _model_checkpoint_phase()
        if phase is None:
            return self.block_called(index, args, kwargs)
        if phase in (_RECOMPUTE, _RECOMPUTE_REENTRANT):
            return self._output_again(index, reentrant=phase == _RECOMPUTE_REENTRANT)
        if not self._said_model_checkpoints:
            self._said_model_checkpoints = True
            if self.on_model_checkpoint is not None:
                self.on_model_checkpoint()
        if phase == _NON_REENTRANT:
            with torch.autograd.graph.saved_tensors_hooks(Tensor.detach, _same):  # innermost hooks win
                return self.block_called(index, args, kwargs)
        # Gradients where the checkpoint's backward would give them: an input of the checkpointed function needs one.
        wants_gradients = any(t.requires_grad for t in _tensors_of(frame.f_locals["args"]))
        with torch.set_grad_enabled(wants_gradients):
            output = self.block_called(index, args, kwargs)
        if not any(t.requires_grad for t in _tensors_of(output)):
            return output  # a placeholder
        call = self._calls[-1]
        call.graph_output, call.output = output, _map_tensors(output, Tensor.detach)
        return call.output

    def _output_again(self, index: int, reentrant: bool) -> Any:
        """The output of this step's call of block ``index`` for the model's checkpoint re-running the call in backward:
        the real one with its graph (backward goes on into the pipeline from there), a placeholder's shapes otherwise
        (as a leaf that needs a gradient where a reentrant checkpoint requires one)."""
        call = next((call for call in reversed(self._calls) if call.index == index), None)
        if call is None:
            raise PipelineOrderError(
                f"torch.utils.checkpoint re-ran {self.region.names[index]} in backward, but the step did not call it"
            )
        if call.graph_output is not None:
            return call.graph_output
        if not reentrant:
            return call.output
        return _map_tensors(call.output, lambda t: _fresh_meta(t).requires_grad_(t.is_floating_point()))

    def block_called(self, index: int, args: tuple, kwargs: dict) -> Any:
        """A call of block ``index`` by the model's code: checked, recorded, answered."""
        if index == 0 and not self.in_step:
            assert self.on_outside_step_start is not None
            self.begin_step(in_step=False)
            self.on_outside_step_start()
        restart, sources = self._check_order(index, args, kwargs)
        # NOTE: a key/value cache (Hugging Face's DynamicCache) would gather every micro-batch's keys and values, and
        # the placeholders' meta-device ones: training needs none, so the pipelined blocks get none.
        args, kwargs = _map_caches(args, _no_cache), _map_caches(kwargs, _no_cache)
        carried = tuple(key for key in sources.values() if key[0] < self._segment_start)
        call = _Call(index, args, kwargs, restart=restart, carried=carried, sources=sources)
        self._calls.append(call)
        output = None
        chunk = self._chunk_ends.get(index)
        if chunk is not None and chunk in self.targets:
            assert self.on_chunk_end is not None
            output = self.on_chunk_end(chunk)
        call.output = output if output is not None else self._placeholder(index, args, kwargs)
        if index == len(self.region) - 1 and not self.in_step:
            assert self.outside_step_output is not None
            call.output = self.outside_step_output(output)
        # The latest block that returned a tensor is its producer: T5's blocks return the position bias they were given.
        self._producers[id(call.output)] = (index, None)
        for item, value in enumerate(_items(call.output)):
            self._producers[id(value)] = (index, item)
        return call.output

    def _check_order(self, index: int, args: tuple, kwargs: dict) -> tuple[bool, dict[int, ChainKey]]:
        """Check a call against the chain so far: whether it restarts the chain, and which of its other arguments are
        earlier blocks' outputs (by id): the previous block's, or those of blocks before the chain's last restart."""
        names = self.region.names
        expected = len(self._calls)
        if index != expected:
            if index < expected:
                raise PipelineOrderError(
                    f"the pipelined module was called twice in one step; {names[index]} ran already. The gpipe"
                    " strategy pipelines one call per step. Call it once (concatenate inputs along the batch"
                    " dimension if needed)."
                )
            raise PipelineOrderError(
                f"the model called {names[index]} before {names[expected]}; the pipeline needs the model's code to call"
                " the pipelined blocks once each, in order (no block skipped). Pipeline a shorter chain"
                " (GPipeStrategy(module_name=...)) or call every block."
            )
        if not args:
            raise PipelineOrderError(
                f"{names[index]} was called without a positional argument; the pipeline passes the first positional"
                " argument from block to block. Call each block with the hidden state as its first argument."
            )
        restart = False
        if expected > 0:
            previous = self._calls[-1].output
            first = args[0]
            takes_first = first_item(previous)
            if first is previous:
                self._takes_first_item = False
            elif takes_first is not None and first is takes_first:
                self._takes_first_item = True
            elif _computed_from_the_batch(first):  # the model's code starts a new chain here (a decoder)
                restart, self._segment_start = True, index
            else:
                raise PipelineOrderError(
                    f"the model's code changes the output of {names[index - 1]} before {names[index]} receives it (the"
                    f" first argument of {names[index]} is not what {names[index - 1]} returned). Only code that passes"
                    " each block's output straight to the next block can be pipelined: move that code into a block, or"
                    " pipeline a shorter chain (GPipeStrategy(module_name=...))."
                )
        sources: dict[int, ChainKey] = {}
        positional = self._argument_names_of_block(index)
        named = [(positional[i + 1] if i + 1 < len(positional) else f"#{i + 1}", value) for i, value in enumerate(args[1:])]
        for argument, value in [*named, *kwargs.items()]:
            if not isinstance(value, Tensor):
                continue
            key = self._producers.get(id(value))
            if key is None:
                if value.is_meta:
                    raise PipelineOrderError(
                        f"the argument {argument!r} of {names[index]} is computed by the model's code from the output of a"
                        " pipelined block: only a block's output itself can reach a later block (it is sent to the"
                        " stage that runs it). Move that code into a block, or pipeline a shorter chain"
                        " (GPipeStrategy(module_name=...))."
                    )
                continue
            sources[id(value)] = key
            if key[0] != index - 1 and key[0] >= self._segment_start:
                raise PipelineOrderError(
                    f"the output of {names[key[0]]} reaches {names[index]} (argument {argument!r}) past the blocks"
                    " between them (a skip connection); a pipeline passes each block's output to the next block only. Keep skip"
                    " connections inside one block (as a ResNet's BasicBlock does), or pipeline a chain without them."
                )
        return restart, sources

    def _placeholder(self, index: int, args: tuple, kwargs: dict, reuse: bool = True) -> Any:
        """The block's output on the meta device: its structure and shapes, without its cost.

        The block runs there once per input signature (training mode, the arguments' shapes, strides and dtypes,
        their plain values); later calls with the same signature get fresh meta tensors shaped as that output. An
        argument or output that holds anything else (an object, a named tuple) makes the block run every time.
        """
        block = self.originals[index]
        known = self._meta_outputs.setdefault(index, {})
        key = _signature((block.training, args, kwargs)) if reuse else None
        if key is not None and key in known:
            return _map_tensors(known[key], _fresh_meta)
        if index not in self._meta_states:
            self._meta_states[index] = {
                name: torch.empty_like(t, device="meta") for name, t in _state(block).items()
            }
        with self._real_calls(), torch.no_grad(), hooks_set_aside(block.modules()):  # no user hook sees meta tensors
            output = torch.func.functional_call(
                block, self._meta_states[index], _map_tensors(args, _to_meta), _map_tensors(kwargs, _to_meta),
                strict=False,
            )
        if key is not None and _signature(output) is not None:
            if len(known) >= _SIGNATURES_KEPT:
                known.clear()  # signatures that change every step (a growing sequence) must not pile up
            known[key] = _map_tensors(output, _fresh_meta)
        return output

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
        blocks = [self.originals[call.index] for call in chunk_call.calls]
        if not any(isinstance(module, _BatchNorm) for block in blocks for module in block.modules()):
            return
        # The observers are registered once the user's hooks are set aside (the placeholders would set them aside too).
        with hooks_set_aside(self.modules()), observed_batch_norm_inputs(self.model, chunk_call.batch) as values:
            for call in chunk_call.calls:
                self._placeholder(call.index, call.args, call.kwargs, reuse=False)  # the hooks must see the shapes
        batch_size = batch_size or chunk_call.batch
        check_micro_batches_fit_batch_norm(self.model, values, batch_size, num_micro_batches)
        if epoch_last_batch is not None:
            check_micro_batches_fit_batch_norm(self.model, values, epoch_last_batch, num_micro_batches, True)

    @contextlib.contextmanager
    def _real_calls(self) -> Iterator[None]:
        executing, self._executing = self._executing, True
        try:
            yield
        finally:
            self._executing = executing

    # ---- running the stage on micro-batches ----------------------------------------------------------------------

    def run_alone(self, value: Any) -> Any:
        """This stage's blocks on ``value`` one after another, outside any step (for measurements)."""
        with self._real_calls():
            for block in self.blocks:
                value = self.travelling(block(value))
        return value

    def chunk_call(self, chunk: int, detach_side_arguments: bool) -> ChunkCall:
        """What the model's code called ``chunk``'s blocks with in this call. With ``detach_side_arguments`` (when a
        backward will follow), side arguments that need a gradient become leaves: see :class:`ChunkCall`."""
        chunk_range = self.chunk_ranges[chunk]
        calls = [call for call in self._calls if call.index in chunk_range]
        if len(calls) != len(chunk_range):
            raise PipelineOrderError("the pipeline ran before every block of this stage was called")
        first = calls[0].args[0]
        carried = tuple(sorted({key for call in self._calls for key in call.carried}, key=_key_order))
        start = calls[0].index
        chunk_call = ChunkCall(
            chunk, calls, (first if isinstance(first, tuple) else (first,))[0].shape[0], carried=carried,
            input_key=self._travelling_key(start - 1) if start > 0 else None,
        )
        leaf = partial(_leaf_of, chunk_call.leaves) if detach_side_arguments else _same

        def side(call: _Call, value: Any) -> Any:
            key = call.sources.get(id(value)) if isinstance(value, Tensor) else None
            return _ChainValue(key) if key is not None else _map_tensors(value, leaf)

        chunk_call.calls = [
            _Call(
                call.index,
                (_map_tensors(call.args[0], leaf) if call.restart else call.args[0],
                 *(side(call, value) for value in call.args[1:])),
                {name: side(call, value) for name, value in call.kwargs.items()},
                restart=call.restart,
            )
            for call in calls
        ]
        return chunk_call

    def run_micro_batch(
        self, chunk_call: ChunkCall, m: int, num: int, is_tuple: bool, carried: tuple[ChainKey, ...], *tensors: Tensor
    ) -> tuple[Any, dict[ChainKey, Tensor]]:
        """The chunk's blocks on micro-batch ``m`` of ``num`` of its call, from ``tensors``: the travelling value (a
        tensor, or a tuple of them) and the earlier blocks' outputs ``carried`` with it. The last block's output, and
        what goes on with it: the values of ``chunk_call.carried`` and the last block's other tensor items (the next
        block may take them: T5's position bias)."""
        # NOTE: the chunk's first block gets a copy of its input. A block that works in place (VGG's
        # `nn.ReLU(inplace=True)` starting a stage) would otherwise modify a received leaf, the view through which
        # its gradient is caught, the first stage's slice of the user's tensor, or the input that re-computation
        # in backward reads again. A carried value passed on is that copy too: an output of this chunk's graph.
        copies = tuple(t.clone() for t in tensors)
        travelling = copies[: len(copies) - len(carried)]
        value: Any = travelling if is_tuple else travelling[0]
        chain = dict(zip(carried, copies[len(travelling):]))
        if chunk_call.input_key is not None:
            chain[chunk_call.input_key] = value
        outputs: dict[int, Any] = {}
        output: Any = None
        with self._real_calls():
            for call in chunk_call.calls:
                take = partial(self._chain_value, chain, outputs, call.index)
                head = _map_tensors(call.args[0], partial(_micro_batch_of, m=m, num=num, batch=chunk_call.batch)) if call.restart else value
                args = (head, *self._split(call, call.args[1:], m, num, chunk_call.batch, True, take))
                kwargs = self._split(call, call.kwargs, m, num, chunk_call.batch, False, take)
                output = self.compiled_calls.get(call.index, self.originals[call.index])(*args, **kwargs)
                outputs[call.index] = output
                value = self.travelling(output)
        last = chunk_call.calls[-1].index
        carried_on = {key: self._chain_value(chain, outputs, last + 1, key) for key in chunk_call.carried}
        if value is not output:  # the first item travels: the others go too
            for item, tensor in list(enumerate(_items(output)))[1:]:
                if isinstance(tensor, Tensor) and (last, item) not in carried_on:
                    carried_on[(last, item)] = tensor
        return output, carried_on

    def _travelling_key(self, index: int) -> ChainKey:
        """Which of block ``index``'s outputs travels to the next block: the output, or its first item."""
        output = self._calls[index].output
        return (index, 0) if self.travelling(output) is not output else (index, None)

    def _chain_value(self, chain: dict[ChainKey, Any], outputs: dict[int, Any], index: int, key: ChainKey) -> Any:
        """The earlier block output ``key`` that block ``index`` takes (or the chunk passes on, for the block after the
        chunk): computed by a block of this chunk, or received with the chunk's input."""
        if key[0] in outputs:
            output = outputs[key[0]]
            return output if key[1] is None else _items(output)[key[1]]
        if key not in chain:
            names = self.region.names
            taker = f"{names[index]} takes" if index < len(names) else "the stage after it takes"
            raise PipelineOrderError(
                f"{taker} the output of {names[key[0]]}, which does not reach pipeline stage {self.stage_index}: an"
                " earlier output travels on with the hidden state only from the first stage whose blocks take it."
                " Put the first block that takes it on the stage of the block before it (GPipeStrategy(balance=...))."
            )
        return chain[key]

    def travelling(self, output: Any) -> Activation:
        """What passes from a block to the next: the output, or its first item where the model's code takes that
        (observed in this step; a tensor or a tuple of tensors travels whole unless seen otherwise). A block that
        returns a tensor among blocks that return tuples (T5's final norm after its blocks) passes that tensor."""
        takes_first = self._takes_first_item
        if takes_first is None:
            takes_first = not (isinstance(output, Tensor) or (isinstance(output, tuple) and all(isinstance(t, Tensor) for t in output)))
        first = first_item(output) if takes_first else None
        return first if first is not None else output

    def _split(
        self, call: _Call, values: Any, m: int, num: int, batch: int, positional: bool,
        chain_value: Callable[[ChainKey], Any],
    ) -> Any:
        """Micro-batch ``m`` of a call's arguments ``values``: each split along the batch dimension where it has it,
        an earlier block's output taken from the chain (``chain_value``: already a micro-batch's)."""
        names = self._argument_names(call) if positional else None

        def part(value: Any, name: str | None) -> Any:
            if isinstance(value, _ChainValue):
                return chain_value(value.key)
            if name in self.unsplit_arguments:
                return value
            return _map_tensors(value, lambda t: _micro_batch_of(t, m, num, batch))

        if positional:
            name = lambda i: names[i + 1] if names and i + 1 < len(names) else None  # noqa: E731
            return tuple(part(value, name(i)) for i, value in enumerate(values))
        return {key: part(value, key) for key, value in values.items()}

    def _argument_names(self, call: _Call) -> list[str] | None:
        """The names of the block's positional parameters, the hidden state's first (``self`` left out)."""
        return self._argument_names_of_block(call.index) or None

    def _argument_names_of_block(self, index: int) -> list[str]:
        if index not in self._argument_names_of:
            try:
                names = list(inspect.signature(type(self.originals[index]).forward).parameters)[1:]
            except (TypeError, ValueError):
                names = None
            self._argument_names_of[index] = names
        return self._argument_names_of[index] or []



def _leaf_of(leaves: dict[int, tuple[Tensor, Tensor]], tensor: Tensor) -> Tensor:
    """``tensor``'s leaf in ``leaves`` (made on first sight) if it needs a gradient, else ``tensor``."""
    if not tensor.requires_grad:
        return tensor
    if id(tensor) not in leaves:
        leaves[id(tensor)] = (tensor, tensor.detach().requires_grad_(True))
    return leaves[id(tensor)][1]


# Where a block call made by the model's code stands in torch.utils.checkpoint (see `StageBlocks.model_call`).
_NON_REENTRANT, _REENTRANT, _RECOMPUTE, _RECOMPUTE_REENTRANT = "non-reentrant", "reentrant", "recompute", "recompute reentrant"
_CHECKPOINT_SOURCE = torch_checkpoint.__file__
_REENTRANT_FORWARD = torch_checkpoint.CheckpointFunction.forward.__code__
_REENTRANT_BACKWARD = torch_checkpoint.CheckpointFunction.backward.__code__


def _model_checkpoint_phase() -> tuple[str | None, FrameType | None]:
    """The innermost ``torch.utils.checkpoint`` phase that the current call is made in, read from the call stack,
    with its frame: a reentrant checkpoint's forward, a non-reentrant one's, either's re-computation in backward;
    ``None`` outside."""
    frame = sys._getframe(2)
    while frame is not None:
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


def _tensors_of(value: Any) -> list[Tensor]:
    found: list[Tensor] = []
    _map_tensors(value, found.append)
    return found


def _avoid_nested_tensors(model: nn.Module, region: Region) -> tuple[nn.TransformerEncoder, bool] | None:
    """Turn off ``nn.TransformerEncoder``'s nested-tensor path when its layers are the region: (encoder, setting).

    In eval without gradients the encoder packs the padded batch into one NestedTensor for its layers, which cannot
    be split into micro-batches or sent between stages; the padded path computes the same outputs."""
    if region.container is None:
        return None
    parent = model.get_submodule(region.container.rpartition(".")[0])  # "" is the model itself
    if not isinstance(parent, nn.TransformerEncoder) or not getattr(parent, "use_nested_tensor", False):
        return None
    parent.use_nested_tensor = False
    return parent, True


def _items(value: Any) -> tuple:
    """The items of a tuple or of a ``ModelOutput``-like object (a mapping that indexes); ``()`` for anything else."""
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return value
    if hasattr(value, "to_tuple") and hasattr(value, "__getitem__"):
        return value.to_tuple()
    return ()


def _key_order(key: ChainKey) -> tuple[int, int]:
    return key[0], -1 if key[1] is None else key[1]


def _computed_from_the_batch(value: Any) -> bool:
    """Whether a block's first argument holds tensors and none is a placeholder: the model's code computed it from
    the batch (a block's output reaches the model's code as a placeholder until the region's end)."""
    tensors = _tensors_of(value)
    return bool(tensors) and not any(t.is_meta for t in tensors)


def _is_cache(value: Any) -> bool:
    """A Hugging Face key/value cache (``transformers.cache_utils.Cache`` and its subclasses)."""
    return any(cls.__name__ == "Cache" and cls.__module__.startswith("transformers") for cls in type(value).__mro__)


def _no_cache(value: Any) -> Any:
    return None if _is_cache(value) else value


def _map_caches(values: Any, function: Callable[[Any], Any]) -> Any:
    if isinstance(values, dict):
        return {key: function(value) for key, value in values.items()}
    return tuple(function(value) for value in values)


def _micro_batch_of(tensor: Tensor, m: int, num: int, batch: int) -> Tensor:
    """Micro-batch ``m`` of a side argument with the batch dimension first; a tensor without it is passed whole."""
    if tensor.dim() == 0 or tensor.shape[0] != batch or batch == 1:
        return tensor
    return torch.tensor_split(tensor, num)[m]


def _map_tensors(value: Any, function: Callable[[Tensor], Any]) -> Any:
    if isinstance(value, Tensor):
        return function(value)
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_map_tensors(item, function) for item in value)
    if isinstance(value, list):
        return [_map_tensors(item, function) for item in value]
    if isinstance(value, dict) and type(value) is dict:
        return {key: _map_tensors(item, function) for key, item in value.items()}
    return value


def _to_meta(tensor: Tensor) -> Tensor:
    return tensor if tensor.is_meta else tensor.to("meta")


def _fresh_meta(tensor: Tensor) -> Tensor:
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")


_SIGNATURES_KEPT = 8
_PLAIN = (bool, int, float, str, torch.dtype, torch.device, type(None))


def _signature(value: Any) -> Hashable | None:
    """What a block's meta output can depend on in ``value``, as a hashable key: each tensor's shape, strides and
    dtype, plain values as they are, containers as ``_map_tensors`` walks them; ``None`` if ``value`` holds anything
    else."""
    if isinstance(value, Tensor):
        return ("tensor", tuple(value.shape), value.stride(), value.dtype)
    if isinstance(value, _PLAIN):
        return (type(value).__name__, value)
    if (isinstance(value, (tuple, list)) and not hasattr(value, "_fields")) or type(value) is dict:
        items = list(value.items()) if isinstance(value, dict) else list(enumerate(value))
        keys = [(key, _signature(item)) for key, item in items]
        if any(key is None for _, key in keys):
            return None
        return (type(value).__name__, tuple(keys))
    return None


def _state(block: nn.Module) -> dict[str, Tensor]:
    return {**dict(block.named_parameters()), **dict(block.named_buffers())}


def _replace_submodule(model: nn.Module, name: str, replacement: nn.Module) -> None:
    parent_name, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attribute, replacement)
