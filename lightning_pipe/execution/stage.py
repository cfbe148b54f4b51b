"""This rank's blocks of the pipelined region, the stand-ins the model's code calls, and the blocks run on a micro-batch.

The model keeps its code: its ``nn.Sequential`` still runs its children in order, its loop still calls
``h = block(h, mask, ...)``. At set-up every block of the region is reached through a stand-in:

* a block of another stage is replaced by a :class:`RemoteBlock` (no parameters here);
* a block of this stage stays where it is (its state-dict keys, name and hooks do not change); its calls are routed:
  its class becomes a subclass of itself and :class:`RoutedBlock`, whose ``__call__`` answers the model's call unless
  the stage runs its blocks (then ``nn.Module.__call__`` runs it, with its hooks and any ``block.compile()``).

Both answer the model's calls through what :meth:`StageBlocks.route` is given (the runtime's
:class:`~lightning_pipe.execution.block_calls.BlockCalls`): each call is checked, recorded and answered with a
placeholder, until the last block of one of this stage's chunks, where the pipeline runs the chunk. The engine then
runs the chunk's blocks on each micro-batch here (:meth:`StageBlocks.run_micro_batch`), with each block's own
arguments, split along the batch dimension where they have it; inside that run a block's call goes straight to it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipe.execution.call_order import (
    BlockCall,
    ChainKey,
    ChainValue,
    ChunkCall,
    PipelineOrderError,
    argument_names,
    items_of,
    map_tensors,
)
from lightning_pipe.partition.region import Region

Answer = Callable[[int, tuple, dict], Any]  # (block index, args, kwargs) -> what the model's call of the block gets


class StandIn(nn.Module):
    """Stands where a module that another stage holds was: the original's attributes read through it (code that
    reads ``layers[0].self_attn.batch_first`` or an embedding's ``embedding_dim``), never its tensors.
    ``_original`` is the module as built (not a submodule: no parameters, no state here)."""

    _own_attributes: tuple[str, ...] = ("_original",)  # set on the instance; absent only while it is built

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in self._own_attributes:
                raise
            original = self._original
            if name in original._parameters or name in original._buffers:
                raise AttributeError(self._held_elsewhere(name)) from None
            return getattr(original, name)

    def _held_elsewhere(self, name: str) -> str:
        raise NotImplementedError


class RemoteBlock(StandIn):
    """Stands where a block of another stage was; its call is answered by ``answer`` (a placeholder of that block's
    output). Before the stage's calls are routed (:meth:`StageBlocks.route`) it only holds the block's place."""

    def __init__(self, index: int, name: str, original: nn.Module, answer: Answer | None = None) -> None:
        super().__init__()
        self.index = index
        self.block_name = name
        object.__setattr__(self, "_original", original)  # not a submodule: no parameters, no state
        object.__setattr__(self, "answer", answer if answer is not None else partial(_not_routed_yet, name))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Not through nn.Module's call: hooks on a stand-in never fire, for the block runs on another rank.
        return self.answer(self.index, args, kwargs)

    _own_attributes = ("_original", "answer")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.answer(self.index, args, kwargs)

    def _held_elsewhere(self, name: str) -> str:
        return f"{self.block_name}.{name} is held by another pipeline stage"

    def extra_repr(self) -> str:
        return f"{self.block_name}, on another pipeline stage"


# NOTE: why a class. Python looks `__call__` up on the type, so only a class can take the model's call of a block
# before nn.Module's call runs the block's hooks and its `block.compile()` code (which would trace the routing).
# A wrapper in the block's place would change its state-dict keys, `get_submodule`, its hooks' module and
# `isinstance`; nn.Module's compiled-call slot (`_compiled_call_impl`) is torch's private attribute. One routed class
# per class of block: blocks of one class keep sharing their compiled code (dynamo guards on the class).


class RoutedBlock(nn.Module):
    """Between a block's own class and ``nn.Module`` while the block is routed (:func:`route_block`): a
    ``__call__`` of the block's own class (Hugging Face's gradient-checkpointing layers) still runs first, and
    reaches this one by its ``super().__call__``. The model's call is answered by the route, unless the stage runs
    its blocks."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        route = self.__dict__.get(_ROUTE)
        if route is None or route.stage._running:  # run by the stage (or routed no more): nn.Module's call
            return super().__call__(*args, **kwargs)
        return route.answer(route.index, args, kwargs)


_ROUTE = "_lightning_pipe_route"  # in a routed block's __dict__: its _Route


class _Route:
    """Where the model's calls of a routed block go: ``answer(index, args, kwargs)``, unless ``stage`` runs its
    blocks. A copy of the model (``copy.deepcopy``) shares it, as it shares the stage."""

    __slots__ = ("stage", "index", "answer")

    def __init__(self, stage: StageBlocks, index: int, answer: Answer) -> None:
        self.stage, self.index, self.answer = stage, index, answer

    def __deepcopy__(self, memo: dict) -> _Route:
        return self


@functools.cache
def routed_class(kind: type[nn.Module]) -> type[nn.Module]:
    """``kind`` with :class:`RoutedBlock` between it and ``nn.Module``, named as ``kind`` (the model reads as it
    was built: Lightning's summary, a check of class names)."""
    return type(kind.__name__, (kind, RoutedBlock), {"__module__": kind.__module__, "__qualname__": kind.__qualname__})


def route_block(block: nn.Module, to: _Route) -> None:
    """Send the model's calls of ``block`` to ``to``: the block's class becomes its routed class."""
    block.__dict__[_ROUTE] = to
    if not isinstance(block, RoutedBlock):
        block.__class__ = routed_class(type(block))


def unroute_block(block: nn.Module) -> None:
    """``block`` as before :func:`route_block`: of its own class again; when a class was given on top of the
    routed one since (FSDP2's ``fully_shard``), that one stays and the routing only stops."""
    block.__dict__.pop(_ROUTE, None)
    kind = type(block)
    if kind.__bases__[-1:] == (RoutedBlock,):
        block.__class__ = kind.__bases__[0]


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
        block_stages: Mapping[int, int] | None = None,
    ) -> None:
        self.model = model
        self.region = region
        self.chunk_ranges = dict(local) if isinstance(local, Mapping) else {stage_index: local}
        self.indices = sorted(i for chunk_range in self.chunk_ranges.values() for i in chunk_range)
        self.num_chunks = num_chunks if num_chunks is not None else num_stages
        self.stage_index = stage_index
        self.num_stages = num_stages
        # The stage holding each block of the region (this stage's, when not given: a stage on its own).
        self.block_stages = dict(block_stages) if block_stages is not None else {i: stage_index for i in self.indices}
        self.unsplit_arguments = frozenset(unsplit_arguments)
        self.originals = region.blocks(model)  # every block as the user built it (the remote ones are not used)
        self.blocks = [self.originals[i] for i in self.indices]
        self.chunk_ends = {chunk_range[-1]: chunk for chunk, chunk_range in self.chunk_ranges.items()}
        self._running = False  # real blocks run (on a micro-batch, or on the meta device): their calls go straight through
        self._nested_tensor_setting: tuple[nn.TransformerEncoder, bool] | None = None
        # What runs a compiled local block on micro-batches (see `compile_stage`): the strategy's compiled call of it,
        # or the block itself where the user compiled it in place (`block.compile()`: nn.Module's call runs that).
        self.compiled_calls: dict[int, Callable[..., Any]] = {}
        self._undo: list[Callable[[], None]] = []

    # ---- the stand-ins -------------------------------------------------------------------------------------------

    def install(self) -> None:
        """Take the other stages' blocks out of the model (a :class:`RemoteBlock` holds each one's place), so that
        only this stage's become real; the model's calls reach the pipeline once :meth:`route` is given them."""
        self._nested_tensor_setting = _avoid_nested_tensors(self.model, self.region)
        for index, (name, block) in enumerate(zip(self.region.names, self.originals)):
            if index not in self.indices:
                replace_submodule(self.model, name, RemoteBlock(index, name, block))

    def route(self, answer: Answer) -> None:
        """Answer the model's calls of every block with ``answer``: remote blocks' stand-ins, local blocks' calls (a
        block runs itself only while :meth:`running_blocks` is open)."""
        for index, (name, block) in enumerate(zip(self.region.names, self.originals)):
            if index not in self.indices:
                replace_submodule(self.model, name, RemoteBlock(index, name, block, answer))
            else:
                route_block(block, _Route(self, index, answer))

    def uninstall(self) -> None:
        """Put every original block back (with their weights as they are), each local one of its own class again."""
        if self._nested_tensor_setting is not None:
            encoder, use_nested_tensor = self._nested_tensor_setting
            encoder.use_nested_tensor = use_nested_tensor
        for undo in reversed(self._undo):
            undo()
        self._undo = []
        for index, (name, block) in enumerate(zip(self.region.names, self.originals)):
            if index not in self.indices:
                replace_submodule(self.model, name, block)
            else:
                unroute_block(block)

    @contextlib.contextmanager
    def showing_whole_model(self) -> Iterator[None]:
        """While open, the model holds every original block again, for code that reads the model as it was built
        (Lightning's model summary): another stage's block is still not run here, its calls answered as its
        stand-in's are."""
        stand_ins: dict[int, RemoteBlock] = {}
        for index, name in enumerate(self.region.names):
            if index not in self.indices:
                stand_ins[index] = stand_in = self.model.get_submodule(name)
                original = self.originals[index]
                # Answered as the stand-in's calls are; its placeholder still runs it.
                route_block(original, _Route(self, index, stand_in.answer))
                replace_submodule(self.model, name, original)
        try:
            yield
        finally:
            for index, stand_in in stand_ins.items():
                unroute_block(self.originals[index])
                replace_submodule(self.model, self.region.names[index], stand_in)

    def on_uninstall(self, undo: Callable[[], None]) -> None:
        """Run ``undo`` when the original blocks are put back (after the run)."""
        self._undo.append(undo)

    def modules(self) -> Iterator[nn.Module]:
        for block in self.blocks:
            yield from block.modules()

    def parameters(self) -> Iterator[nn.Parameter]:
        for block in self.blocks:
            yield from block.parameters()

    def buffers(self) -> Iterator[Tensor]:
        for block in self.blocks:
            yield from block.buffers()

    @contextlib.contextmanager
    def running_blocks(self) -> Iterator[None]:
        """While open, a call of one of the region's blocks runs the block itself, not its stand-in."""
        running, self._running = self._running, True
        try:
            yield
        finally:
            self._running = running

    # ---- running the stage on micro-batches ----------------------------------------------------------------------

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
        with self.running_blocks():
            for call in chunk_call.calls:
                head = map_tensors(call.args[0], partial(_micro_batch_of, m=m, num=num, batch=chunk_call.batch)) if call.restart else value
                if len(call.args) == 1 and not call.kwargs:  # the hidden state alone: nothing to split
                    args, kwargs = (head,), {}
                else:
                    take = partial(self._chain_value, chain, outputs, call.index)
                    args = (head, *self._split(call, call.args[1:], m, num, chunk_call.batch, True, take))
                    kwargs = self._split(call, call.kwargs, m, num, chunk_call.batch, False, take)
                output = self.compiled_calls.get(call.index, self.originals[call.index])(*args, **kwargs)
                outputs[call.index] = output
                value = chunk_call.travelling(output)
        last = chunk_call.calls[-1].index
        carried_on = {key: self._chain_value(chain, outputs, last + 1, key) for key in chunk_call.carried}
        if value is not output:  # the first item travels: the others go too
            for item, tensor in list(enumerate(items_of(output)))[1:]:
                if isinstance(tensor, Tensor) and (last, item) not in carried_on:
                    carried_on[(last, item)] = tensor
        return output, carried_on

    def _chain_value(self, chain: dict[ChainKey, Any], outputs: dict[int, Any], index: int, key: ChainKey) -> Any:
        """The earlier block output ``key`` that block ``index`` takes (or the chunk passes on, for the block after the
        chunk): computed by a block of this chunk, or received with the chunk's input."""
        if key[0] in outputs:
            output = outputs[key[0]]
            return output if key[1] is None else items_of(output)[key[1]]
        if key not in chain:
            names = self.region.names
            taker = f"{names[index]} takes" if index < len(names) else "the stage after it takes"
            raise PipelineOrderError(
                f"{taker} the output of {names[key[0]]}, which does not reach pipeline stage {self.stage_index}: an"
                " earlier output travels on with the hidden state only from the first stage whose blocks take it."
                " Put the first block that takes it on the stage of the block before it (GPipeStrategy(balance=...))."
            )
        return chain[key]

    def _split(
        self, call: BlockCall, values: Any, m: int, num: int, batch: int, positional: bool,
        chain_value: Callable[[ChainKey], Any],
    ) -> Any:
        """Micro-batch ``m`` of a call's arguments ``values``: each split along the batch dimension where it has it,
        an earlier block's output taken from the chain (``chain_value``: already a micro-batch's)."""
        names = argument_names(type(self.originals[call.index])) if positional else None

        def part(value: Any, name: str | None) -> Any:
            if isinstance(value, ChainValue):
                return chain_value(value.key)
            if name in self.unsplit_arguments:
                return value
            return map_tensors(value, lambda t: _micro_batch_of(t, m, num, batch))

        if positional:
            name = lambda i: names[i + 1] if names and i + 1 < len(names) else None  # noqa: E731
            return tuple(part(value, name(i)) for i, value in enumerate(values))
        return {key: part(value, key) for key, value in values.items()}


def _not_routed_yet(name: str, index: int, args: tuple, kwargs: dict) -> Any:
    raise RuntimeError(
        f"{name} was called before the pipeline was built (its stage's runtime routes the model's calls); call the"
        " model once the Trainer has set the strategy up"
    )


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


def _micro_batch_of(tensor: Tensor, m: int, num: int, batch: int) -> Tensor:
    """Micro-batch ``m`` of a side argument with the batch dimension first; a tensor without it is passed whole."""
    if tensor.dim() == 0 or tensor.shape[0] != batch or batch == 1:
        return tensor
    return torch.tensor_split(tensor, num)[m]


def replace_submodule(model: nn.Module, name: str, replacement: nn.Module) -> None:
    parent_name, _, attribute = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attribute, replacement)
