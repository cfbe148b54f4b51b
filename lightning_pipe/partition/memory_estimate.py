"""What each block costs in memory, estimated without weights: for ``balance="memory"`` on a model built on the meta
device.

A stage's peak holds two kinds of bytes:

* **state**, known from the parameters' shapes and dtypes: each parameter, its gradient and the optimizer's state
  (:data:`OPTIMIZER_STATES` tensors of its size: Adam's two moments; the optimizer is configured after the split, so
  the common case is assumed);
* **activations**, the tensors autograd saves for backward. The training step runs once on the meta device on the
  first batch's shapes with gradients on (:func:`lightning_pipe.partition.meta_run.run_on_meta`), and
  ``torch.autograd.graph.saved_tensors_hooks`` counts the bytes of each storage saved while each block runs. What
  the code outside the blocks saves is charged where it is held, as :func:`lightning_pipe.partition.balance.charged`
  charges the outside modules' parameters: the embedding's to the first block, the head's and the loss's (the
  logits) to the last, what runs between two blocks to the next.

:func:`memory_costs` turns those byte counts into each block's cost at a stage's peak, a pure function whose
costs :func:`lightning_pipe.partition.balance.min_max_partition` splits. A model built with its weights keeps the measured path
(:func:`lightning_pipe.partition.profiling.profile_blocks`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from lightning_pipe.partition.hooks import hooks_set_aside
from lightning_pipe.partition.meta_run import run_on_meta

OPTIMIZER_STATES = 2  # tensors of a parameter's size the optimizer keeps: Adam's and AdamW's two moments


@dataclass(frozen=True)
class BlockMemory:
    """The bytes one block accounts for, over the whole batch.

    ``state_bytes``: its parameters, their gradients and optimizer state, and those of the outside modules charged
    to it. ``activation_bytes``: what autograd saves while the block runs. ``outside_activation_bytes``: what the
    code outside the blocks charged to it saves (the embedding's before the first block, the head's and the loss's
    after the last)."""

    state_bytes: int
    activation_bytes: int = 0
    outside_activation_bytes: int = 0


def memory_costs(blocks: Sequence[BlockMemory], blocks_share: float, outside_share: float) -> list[float]:
    """Each block's bytes at its stage's peak: its state, plus the share of the batch whose activations a stage
    holds at once: ``blocks_share`` for the blocks' (micro-batches kept whole until their backward, as a share of
    the batch), ``outside_share`` for the code outside them (1 when the loss runs on the whole batch, ``1/M`` when
    it runs per micro-batch).

    >>> memory_costs([BlockMemory(100, 40, 0), BlockMemory(100, 40, 80)], 0.25, 1.0)
    [110.0, 190.0]
    """
    return [b.state_bytes + b.activation_bytes * blocks_share + b.outside_activation_bytes * outside_share for b in blocks]


def held_micro_batches(num_micro_batches: int, recompute_fraction: float) -> float:
    """The share of the batch whose block activations a stage holds at its peak: the micro-batches not re-computed
    keep theirs until their backward; a re-computed one holds its own only during its backward, one at a time."""
    kept = num_micro_batches * (1.0 - recompute_fraction)
    return max(1.0, kept) / num_micro_batches


@dataclass(frozen=True)
class StateLayout:
    """How the ``replicas`` of a stage hold its blocks' state: GPipeStrategy's ``data_parallel``.

    >>> [StateLayout(mode, 4).copies() for mode in ("replicate", "shard", "full_shard")]
    [4, 3.0, 1.0]
    """

    data_parallel: str = "replicate"
    replicas: int = 1
    # With tensor parallelism: the elements one rank holds of each parameter a block's plan splits (by the
    # parameter's id; see lightning_pipe.partition.tensor_slices); the others are held whole.
    rank_elements: Mapping[int, int] = field(default_factory=dict, compare=False)

    def elements(self, parameter: Tensor) -> int:
        """The elements of ``parameter`` a rank holds before the replicas shard it: its tensor-parallel slice."""
        return self.rank_elements.get(id(parameter), parameter.numel())

    def copies(self, trained: bool = True) -> float:
        """Parameter-sized tensors a rank holds at its step's peak for each parameter of its stage's blocks: the
        parameter, and when ``trained`` its gradient and :data:`OPTIMIZER_STATES` tensors. ``"replicate"`` holds
        them all; ``"full_shard"`` a ``1/replicas`` share of each (the running block's gathered weights and gradient
        aside); ``"shard"`` those shares and, during the step, the stage's whole weights and whole gradient."""
        held = 1 + (1 + OPTIMIZER_STATES) * trained
        if self.data_parallel == "replicate" or self.replicas == 1:
            return held
        whole_during_step = (2 if trained else 1) if self.data_parallel == "shard" else 0
        return whole_during_step + held / self.replicas


def rank_state_bytes(
    stage_parameters: float, largest_block: float, data_parallel: str, replicas: int, precision: str = "32-true"
) -> float:
    """The bytes of state a rank of a stage holding ``stage_parameters`` parameters (``largest_block`` of them in its
    largest block or outside module) keeps at its step's peak, from the parameter counts alone: each parameter, its
    gradient and Adam's two moments in float32, as Lightning keeps them under every mixed precision (16 bytes a
    parameter), held as ``data_parallel`` says over ``replicas`` (see :mod:`lightning_pipe.execution.sharding`):

    * ``"replicate"``: all of it;
    * ``"full_shard"``: a ``1/replicas`` share, and one block's gathered weights and gradient while it runs;
    * ``"shard"``: that share, and the stage's gathered weights and whole gradient through the step.

    Weights are gathered in bfloat16 under ``precision="bf16-mixed"`` (FSDP2's ``MixedPrecisionPolicy``), else in
    float32; the gradient a step accumulates is float32. Activations are not counted.

    >>> [rank_state_bytes(8, 1, mode, 4, "bf16-mixed") for mode in ("replicate", "shard", "full_shard")]
    [128, 80.0, 38.0]
    """
    state = 4 * (2 + OPTIMIZER_STATES)
    if data_parallel == "replicate" or replicas == 1:
        return state * stage_parameters
    gathered = (2 if precision == "bf16-mixed" else 4) + 4  # the weights, and their whole float32 gradient
    whole = stage_parameters if data_parallel == "shard" else largest_block
    return state * stage_parameters / replicas + gathered * whole


def state_bytes(parameters: Sequence[nn.Parameter], training: bool = True, layout: StateLayout = StateLayout()) -> int:
    """A parameter's bytes, and when ``training``, those of its gradient and :data:`OPTIMIZER_STATES` tensors of its
    size for each one that requires a gradient; held as ``layout`` says (by default whole; with tensor parallelism a
    split parameter's slice)."""
    total = 0.0
    for p in parameters:
        size = layout.elements(p) * p.element_size()
        total += size * layout.copies(training and p.requires_grad)
    return round(total)


def estimate_block_memory(
    model: nn.Module,
    blocks: Sequence[nn.Module],
    calling: Callable[[nn.Module], Any] | None,
    charges: Sequence[tuple[int, nn.Module]] = (),
    layout: StateLayout = StateLayout(),
) -> list[BlockMemory]:
    """Each block's :class:`BlockMemory`, without weights: the state from shapes and dtypes, held as ``layout`` says
    (``charges``: outside modules added to the block whose stage holds them, whole on every rank), the
    activations from ``calling(model)`` (the training step on the first batch's shapes) run on the meta device.
    ``calling`` is ``None`` outside training: no gradient, no optimizer state, nothing saved. Raises, naming the
    fix, when the step cannot run on the meta device."""
    training = calling is not None
    own = [state_bytes(list(block.parameters()), training, layout) for block in blocks]
    for index, module in charges:
        own[index] += state_bytes(list(module.parameters()), training)
    if calling is None:
        return [BlockMemory(size) for size in own]
    inside, outside = _saved_bytes_on_meta(model, blocks, calling)
    return [BlockMemory(size, saved, extra) for size, saved, extra in zip(own, inside, outside)]


def _saved_bytes_on_meta(
    model: nn.Module, blocks: Sequence[nn.Module], calling: Callable[[nn.Module], Any]
) -> tuple[list[int], list[int]]:
    """The bytes autograd saves in ``calling(model)`` on the meta device: while each block runs, and outside the
    blocks charged to the next block called (after the last, to the last). Each storage counts once, whole (a view
    saved twice, an input three projections save), and the parameters' not at all."""
    inside = [0] * len(blocks)
    outside = [0] * len(blocks)
    pending = [0]  # saved outside the blocks since the last block ended
    current: list[int | None] = [None]
    seen: set[int] = set()
    kept: list[Tensor] = []  # alive to the end: a storage freed early could come back at the same address
    parameter_storages: set[int] = set()

    def pack(tensor: Tensor) -> Tensor:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in seen or key in parameter_storages or isinstance(tensor, nn.Parameter):
            return tensor
        seen.add(key)
        kept.append(tensor)
        if current[0] is None:
            pending[0] += storage.nbytes()
        else:
            inside[current[0]] += storage.nbytes()
        return tensor

    def before(index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            outside[index] += pending[0]
            pending[0] = 0
            current[0] = index

        return hook

    def after(module: nn.Module, args: Any, output: Any) -> None:
        current[0] = None

    def step(meta_model: nn.Module) -> Any:
        # The meta copies of the parameters, as functional_call placed them: saved, they are state, not activations.
        parameter_storages.update(p.untyped_storage()._cdata for p in meta_model.parameters())
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            return calling(meta_model)

    with hooks_set_aside(model.modules()):
        handles = [h for i, block in enumerate(blocks)
                   for h in (block.register_forward_pre_hook(before(i)), block.register_forward_hook(after))]
        try:
            output = run_on_meta(model, step, gradients=True)
        finally:
            for handle in handles:
                handle.remove()
    if output is None:
        raise ValueError(
            "balance='memory' on a model built on the meta device estimates each block's activations from the"
            " training step run on the meta device, but the step failed there (code that reads tensor values,"
            " or calls that need real data); use balance='parameters' or a list of blocks per stage, or build"
            " the model in __init__ so that its blocks can be profiled."
        )
    outside[-1] += pending[0]
    return inside, outside
