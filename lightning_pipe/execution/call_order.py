"""The model's calls of the pipelined blocks in one step, checked as a chain, and what each chunk's blocks got.

Every call's first argument must be the previous block's output (or that output's first item), or an input the
model's code computed from the batch: the chain restarts there, as an encoder-decoder's decoder starts from the
embedded target. Besides the previous block's output, a block may take the output of a block before the chain's last
restart (the decoder's blocks take the encoder's output): that output is carried along with the hidden state to every
later stage (see :class:`ChunkCall`), and its gradient back; so are the other items of a stage's last output (T5's
blocks pass their position bias on). Any other earlier output (a skip past the next block) is refused.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from torch import Tensor, nn

from lightning_pipe.partition.microbatch import Activation
from lightning_pipe.partition.region import first_item


class PipelineOrderError(RuntimeError):
    """The model's code does not call the pipelined blocks as a chain."""


ChainKey = tuple[int, "int | None"]  # a block's output (index, None) or one of its items (index, item)


@dataclass(frozen=True)
class ChainValue:
    """In a chunk's recorded call: an argument that is an earlier block's output, taken from the chain when the
    chunk runs (received with the activation, or computed by a block of the chunk)."""

    key: ChainKey


@dataclass
class BlockCall:
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
    calls: list[BlockCall]
    batch: int  # the batch size of the chunk's input in this call
    # What passes from a block to the next, as the model's code takes it (see `CallChain.travelling`).
    travelling: Callable[[Any], Activation]
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


class CallChain:
    """The calls of the region's blocks (``originals``, named ``names``) made so far in this call of the model."""

    def __init__(self, names: Sequence[str], originals: Sequence[nn.Module]) -> None:
        self.names = names
        self.originals = originals
        self.calls: list[BlockCall] = []
        self._producers: dict[int, ChainKey] = {}  # id of a block output (or item) in this step -> where it came from
        self.segment_start = 0  # the index of the block where the chain last restarted
        self._takes_first_item: bool | None = None  # the model passes output[0], not the output, to the next block

    def begin(self) -> None:
        """A new call of the model: no block called yet (what the model passes on stays known)."""
        self.calls = []
        self._producers = {}
        self.segment_start = 0

    def record(self, call: BlockCall) -> None:
        """``call``'s output, as the model's code got it: the latest block that returned a tensor is its producer (T5's
        blocks return the position bias they were given)."""
        self._producers[id(call.output)] = (call.index, None)
        for item, value in enumerate(items_of(call.output)):
            self._producers[id(value)] = (call.index, item)

    def travelling(self, output: Any) -> Activation:
        """What passes from a block to the next: the output, or its first item where the model's code takes that
        (observed in this step; a tensor or a tuple of tensors travels whole unless seen otherwise). A block that
        returns a tensor among blocks that return tuples (T5's final norm after its blocks) passes that tensor."""
        takes_first = self._takes_first_item
        if takes_first is None:
            takes_first = not (isinstance(output, Tensor) or (isinstance(output, tuple) and all(isinstance(t, Tensor) for t in output)))
        first = first_item(output) if takes_first else None
        return first if first is not None else output

    def chained(self, index: int, args: tuple, kwargs: dict) -> BlockCall | None:
        """The call of block ``index``, appended, where it is the chain's plain link: the next block, given the
        previous block's output alone (as a Sequential calls it), which leaves nothing to check; ``None`` for any
        other call (see :meth:`check`)."""
        calls = self.calls
        if kwargs or len(args) != 1 or index != len(calls) or not calls or args[0] is not calls[-1].output:
            return None
        self._takes_first_item = False
        call = BlockCall(index, args, kwargs)
        calls.append(call)
        return call

    def check(self, index: int, args: tuple, kwargs: dict) -> tuple[bool, dict[int, ChainKey]]:
        """Check a call against the chain so far: whether it restarts the chain, and which of its other arguments are
        earlier blocks' outputs (by id): the previous block's, or those of blocks before the chain's last restart."""
        self._check_position(index, args)
        restart = index > 0 and self._restarts(index, args[0])
        positional = argument_names(type(self.originals[index]))
        named = [(positional[i + 1] if i + 1 < len(positional) else f"#{i + 1}", value) for i, value in enumerate(args[1:])]
        sources: dict[int, ChainKey] = {}
        for argument, value in [*named, *kwargs.items()]:
            key = self._source(index, argument, value) if isinstance(value, Tensor) else None
            if key is not None:
                sources[id(value)] = key
        return restart, sources

    def _check_position(self, index: int, args: tuple) -> None:
        """Refuse a block called out of order, twice, or without its hidden state."""
        names, expected = self.names, len(self.calls)
        if index < expected:
            raise PipelineOrderError(
                f"the pipelined module was called twice in one step; {names[index]} ran already. The gpipe"
                " strategy pipelines one call per step. Call it once (concatenate inputs along the batch"
                " dimension if needed)."
            )
        if index > expected:
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

    def _restarts(self, index: int, first: Any) -> bool:
        """Whether block ``index``'s first argument starts a new chain; learns whether the model passes the previous
        output or its first item; refuses anything else."""
        names = self.names
        previous = self.calls[-1].output
        takes_first = first_item(previous)
        if first is previous:
            self._takes_first_item = False
        elif takes_first is not None and first is takes_first:
            self._takes_first_item = True
        elif _computed_from_the_batch(first):  # the model's code starts a new chain here (a decoder)
            self.segment_start = index
            return True
        else:
            raise PipelineOrderError(
                f"the model's code changes the output of {names[index - 1]} before {names[index]} receives it (the"
                f" first argument of {names[index]} is not what {names[index - 1]} returned). Only code that passes"
                " each block's output straight to the next block can be pipelined: move that code into a block, or"
                " pipeline a shorter chain (GPipeStrategy(module_name=...))."
            )
        return False

    def _source(self, index: int, argument: str, value: Tensor) -> ChainKey | None:
        """Which earlier block output the tensor argument ``value`` of block ``index`` is, if any."""
        names = self.names
        key = self._producers.get(id(value))
        if key is None:
            if value.is_meta:
                raise PipelineOrderError(
                    f"the argument {argument!r} of {names[index]} is computed by the model's code from the output of a"
                    " pipelined block: only a block's output itself can reach a later block (it is sent to the"
                    " stage that runs it). Move that code into a block, or pipeline a shorter chain"
                    " (GPipeStrategy(module_name=...))."
                )
            return None
        if key[0] != index - 1 and key[0] >= self.segment_start:
            raise PipelineOrderError(
                f"the output of {names[key[0]]} reaches {names[index]} (argument {argument!r}) past the blocks"
                " between them (a skip connection); a pipeline passes each block's output to the next block only. Keep skip"
                " connections inside one block (as a ResNet's BasicBlock does), or pipeline a chain without them."
            )
        return key

    def chunk_call(self, chunk: int, chunk_range: range, detach_side_arguments: bool) -> ChunkCall:
        """What the model's code called ``chunk``'s blocks (``chunk_range``) with in this call. With
        ``detach_side_arguments`` (when a backward will follow), side arguments that need a gradient become leaves:
        see :class:`ChunkCall`."""
        calls = [call for call in self.calls if call.index in chunk_range]
        if len(calls) != len(chunk_range):
            raise PipelineOrderError("the pipeline ran before every block of this stage was called")
        first = calls[0].args[0]
        carried = tuple(sorted({key for call in self.calls for key in call.carried}, key=_key_order))
        start = calls[0].index
        chunk_call = ChunkCall(
            chunk, calls, (first if isinstance(first, tuple) else (first,))[0].shape[0], self.travelling,
            carried=carried, input_key=self._travelling_key(start - 1) if start > 0 else None,
        )
        leaf = partial(_leaf_of, chunk_call.leaves) if detach_side_arguments else _same

        def side(call: BlockCall, value: Any) -> Any:
            key = call.sources.get(id(value)) if isinstance(value, Tensor) else None
            return ChainValue(key) if key is not None else map_tensors(value, leaf)

        chunk_call.calls = [
            BlockCall(
                call.index,
                (map_tensors(call.args[0], leaf) if call.restart else call.args[0],
                 *(side(call, value) for value in call.args[1:])),
                {name: side(call, value) for name, value in call.kwargs.items()},
                restart=call.restart,
            )
            for call in calls
        ]
        return chunk_call

    def _travelling_key(self, index: int) -> ChainKey:
        """Which of block ``index``'s outputs travels to the next block: the output, or its first item."""
        output = self.calls[index].output
        return (index, 0) if self.travelling(output) is not output else (index, None)


@functools.cache
def argument_names(block_type: type[nn.Module]) -> list[str]:
    """The names of a block type's positional parameters, the hidden state's first (``self`` left out)."""
    try:
        return list(inspect.signature(block_type.forward).parameters)[1:]
    except (TypeError, ValueError):
        return []


def items_of(value: Any) -> tuple:
    """The items of a tuple or of a ``ModelOutput``-like object (a mapping that indexes); ``()`` for anything else."""
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return value
    if hasattr(value, "to_tuple") and hasattr(value, "__getitem__"):
        return value.to_tuple()
    return ()


def map_tensors(value: Any, function: Callable[[Tensor], Any]) -> Any:
    """``value`` with ``function`` applied to every tensor in its plain tuples, lists and dicts."""
    if isinstance(value, Tensor):
        return function(value)
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(map_tensors(item, function) for item in value)
    if isinstance(value, list):
        return [map_tensors(item, function) for item in value]
    if isinstance(value, dict) and type(value) is dict:
        return {key: map_tensors(item, function) for key, item in value.items()}
    return value


def tensors_of(value: Any) -> list[Tensor]:
    found: list[Tensor] = []
    map_tensors(value, found.append)
    return found


def _same(value: Any) -> Any:
    return value


def _leaf_of(leaves: dict[int, tuple[Tensor, Tensor]], tensor: Tensor) -> Tensor:
    """``tensor``'s leaf in ``leaves`` (made on first sight) if it needs a gradient, else ``tensor``."""
    if not tensor.requires_grad:
        return tensor
    if id(tensor) not in leaves:
        leaves[id(tensor)] = (tensor, tensor.detach().requires_grad_(True))
    return leaves[id(tensor)][1]


def _key_order(key: ChainKey) -> tuple[int, int]:
    return key[0], -1 if key[1] is None else key[1]


def _computed_from_the_batch(value: Any) -> bool:
    """Whether a block's first argument holds tensors and none is a placeholder: the model's code computed it from
    the batch (a block's output reaches the model's code as a placeholder until the region's end)."""
    tensors = tensors_of(value)
    return bool(tensors) and not any(t.is_meta for t in tensors)
