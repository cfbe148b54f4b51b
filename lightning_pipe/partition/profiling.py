"""Measuring what each block of the pipelined ``nn.Sequential`` costs: forward and backward time, and memory.

Profiling runs on one rank before the partition exists, on a deep copy of one block at a time (so the model's
weights, gradients and BatchNorm statistics stay untouched and a model too big for one device can still be
profiled), with the input each block would see in the pipeline: the first micro-batch of a sample.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from torch import Tensor, nn

from lightning_pipe.partition import microbatch
from lightning_pipe.partition.microbatch import Activation
from lightning_pipe.partition.step_probe import first_training_batch, random_state_kept, training_step_on
from lightning_pipe.schedules.choice import BlockCosts, CostModel


@dataclass(frozen=True)
class BlockProfile:
    """What one block costs on one micro-batch."""

    forward_seconds: float
    backward_seconds: float  # back-propagation through the block, re-computation not included
    parameter_bytes: int
    activation_bytes: int  # storages autograd saves for the block's backward, each once (its parameters not counted)
    # The gradient of the block's input alone (what the stage before waits for), when asked for; the weight
    # gradients take the rest of ``backward_seconds``.
    input_gradient_seconds: float | None = None
    input_bytes: int = 0  # the block's input: what a re-computed forward keeps until its backward

    @property
    def memory_bytes(self) -> int:
        return self.parameter_bytes + self.activation_bytes


class _Captured(BaseException):
    """Stops the sample's forward at the pipelined module. A ``BaseException`` so a user's ``except Exception``
    around the call does not swallow it."""

    def __init__(self, value: Activation) -> None:
        super().__init__()
        self.value = value


@dataclass(frozen=True)
class TrainingBatch:
    """A batch of the training DataLoader to profile with, where no input of ``forward`` is known: the blocks' input
    is what the training step on it passes to the first block."""

    batch: Any


def profiling_input(sample: Any, module: nn.Module) -> Any:
    """What to profile ``module``'s blocks on: ``sample``, else ``module``'s ``example_input_array``, else during a
    fit the first training batch (a :class:`TrainingBatch`, read with the random state kept); ``None`` where there is
    none of them."""
    if sample is None:
        sample = getattr(module, "example_input_array", None)
    trainer = getattr(module, "_trainer", None)
    if sample is not None or trainer is None or trainer.state.fn != "fit":
        return sample
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    with random_state_kept():
        batch = first_training_batch(trainer, module, device)
    return None if batch is None else TrainingBatch(batch)


def pipelined_input(module: nn.Module, sequential: nn.Sequential, sample: Any) -> Activation:
    """The input the pipelined ``sequential`` receives when ``module`` is called on ``sample``.

    ``sample`` is an input of ``module``'s ``forward`` (a LightningModule's ``example_input_array``): a tuple is
    passed as positional arguments, a dict as keyword arguments, anything else as the one argument; or a
    :class:`TrainingBatch`, which the module's ``training_step`` is called on (``self.log`` doing nothing). The call
    runs in eval mode without gradients and stops where ``sequential`` would start, so no block runs, no running
    statistic changes and the random number generators end as they began.
    """

    def capture(_module: nn.Module, args: tuple[Any, ...]) -> None:
        raise _Captured(args[0])

    # The first block's first argument: what a Sequential passes on, or what the model's loop calls its blocks with.
    handle = sequential[0].register_forward_pre_hook(capture)
    modes = {submodule: submodule.training for submodule in module.modules()}
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    if isinstance(sample, TrainingBatch):
        sample = TrainingBatch(move_data_to_device(sample.batch, device))
    else:
        sample = move_data_to_device(sample, device)
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=_rng_devices(device)):
            module.eval()
            if isinstance(sample, TrainingBatch):
                training_step_on(sample.batch)(module)
            elif isinstance(sample, tuple):
                module(*sample)
            elif isinstance(sample, dict):
                module(**sample)
            else:
                module(sample)
    except _Captured as captured:
        return captured.value
    finally:
        handle.remove()
        for submodule, training in modes.items():
            submodule.training = training
    if isinstance(sample, TrainingBatch):
        raise ValueError(
            f"{type(module).__name__}'s training_step on the first training batch never called the pipelined blocks"
            " (their first is never called), so their input is unknown; set `example_input_array` or pass"
            " GPipeStrategy(sample=...) with an input of forward that calls them."
        )
    raise ValueError(
        f"calling {type(module).__name__} on the sample never called the pipelined nn.Sequential, so its input is"
        " unknown; make the LightningModule's forward call the pipelined module, or pass a sample that does."
    )


def profile_blocks(
    sequential: nn.Sequential,
    sample: Activation,
    device: torch.device,
    num_micro_batches: int = 1,
    seconds_per_block: float = 0.05,
    min_repeats: int = 3,
    split_backward: bool = False,
) -> list[BlockProfile]:
    """Forward and backward time and memory of every block of ``sequential`` on ``device``.

    ``sample`` is the input of ``sequential`` (see :func:`pipelined_input`); each block runs on the first of its
    ``num_micro_batches`` micro-batches, as a stage would. Each block is timed ``min_repeats`` times or for about
    ``seconds_per_block``, whichever takes longer, after one warm-up run; the fastest run counts, since other
    processes on the machine only ever add time (as ``timeit`` reasons). With ``split_backward`` each run also times
    the input gradient alone first (``torch.autograd.grad`` to the block's input), which the split backward of the
    zero-bubble schedules runs apart from the weight gradients.
    """
    value = microbatch.split(move_data_to_device(_real(sample, device), device), num_micro_batches)[0]
    profiles = []
    with torch.random.fork_rng(devices=_rng_devices(device)):
        for index, block in enumerate(sequential):
            profile, value = _profile_block(
                block, value, device, seconds_per_block, min_repeats, index, split_backward
            )
            profiles.append(profile)
    return profiles


def _profile_block(
    block: nn.Module, value: Activation, device: torch.device, budget: float, min_repeats: int, index: int,
    split_backward: bool = False,
) -> tuple[BlockProfile, Activation]:
    """The profile of one block and its output (the next block's input), detached."""
    block = _materialized(copy.deepcopy(block), device)
    is_tuple = isinstance(value, tuple)
    where = f"the input of block {index} of the pipelined module"
    inputs = tuple(t.detach().requires_grad_(t.is_floating_point()) for t in microbatch.as_tensors(value, where))
    parameter_storages = {p.untyped_storage().data_ptr() for p in block.parameters()}
    parameter_bytes = sum(p.numel() * p.element_size() for p in block.parameters())
    sync = _synchronizer(device)

    forwards: list[float] = []
    backwards: list[float] = []
    input_gradients: list[float] = []
    differentiable = [t for t in inputs if t.requires_grad]
    activation_bytes = 0
    output: Activation = value
    spent, run = 0.0, 0
    while run <= min_repeats or spent < budget:  # run 0 is the warm-up
        saved: dict[int, int] = {}

        def pack(tensor: Tensor, saved: dict[int, int] = saved) -> Tensor:
            # Each storage once, whole: a view saved beside its base (a Linear's input reshaped) holds no more.
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in parameter_storages:
                saved[storage.data_ptr()] = storage.nbytes()
            return tensor

        # A block that works in place (``nn.ReLU(inplace=True)``) may not modify a leaf that requires grad, and must
        # not modify the input the next run reuses: it gets a copy, made outside the timed span.
        copies = tuple(t.clone() for t in inputs)
        sync()
        start = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            output = block(copies if is_tuple else copies[0])
        sync()
        middle = time.perf_counter()
        outputs = microbatch.as_tensors(output, f"the output of block {index} of the pipelined module")
        needing = [t for t in outputs if t.requires_grad]
        ones = [torch.ones_like(t) for t in needing]
        input_gradient, backward_start = 0.0, middle
        if split_backward and needing and differentiable:  # the input's gradient alone, the graph kept
            torch.autograd.grad(needing, differentiable, ones, retain_graph=True, allow_unused=True)
            sync()
            backward_start = time.perf_counter()
            input_gradient = backward_start - middle
        if needing:
            torch.autograd.backward(needing, ones)
        sync()
        end = time.perf_counter()
        if run > 0:
            forwards.append(middle - start)
            backwards.append(end - backward_start)
            input_gradients.append(input_gradient)
            spent += end - start
        activation_bytes = sum(saved.values())
        block.zero_grad(set_to_none=True)
        for tensor in inputs:
            tensor.grad = None
        run += 1
    detached = tuple(t.detach() for t in microbatch.as_tensors(output, "the output"))
    input_bytes = sum(t.numel() * t.element_size() for t in inputs)
    profile = BlockProfile(
        min(forwards), min(backwards), parameter_bytes, activation_bytes,
        min(input_gradients) if split_backward else None, input_bytes,
    )
    return profile, detached if isinstance(output, tuple) else detached[0]


def _materialized(block: nn.Module, device: torch.device) -> nn.Module:
    """``block`` on ``device``; a block built on the meta device (deferred initialisation) gets freshly initialised
    weights there: timing and sizes do not depend on the values."""
    if not any(t.is_meta for t in (*block.parameters(), *block.buffers())):
        return block.to(device)
    block = block.to_empty(device=device)
    for module in block.modules():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()
    return block


def _real(value: Activation, device: torch.device) -> Activation:
    """The sample input with meta tensors (from modules before the pipeline still on the meta device) replaced by
    random ones of the same shape and dtype."""
    tensors = microbatch.as_tensors(value, "the input of the pipelined module")
    if not any(t.is_meta for t in tensors):
        return value
    def filled(t: Tensor) -> Tensor:
        make = torch.randn if t.is_floating_point() else torch.zeros
        return make(t.shape, dtype=t.dtype, device=device) if t.is_meta else t

    real = tuple(filled(t) for t in tensors)
    return real if isinstance(value, tuple) else real[0]


def _synchronizer(device: torch.device) -> Callable[[], None]:
    """Waits for the device's queued work, so that host clocks time the work and not its launch."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    if device.type == "cpu":
        return lambda: None
    return lambda: torch.accelerator.synchronize(device)


def _rng_devices(device: torch.device) -> list[int]:
    return [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []


def block_cost_model(
    module: nn.Module, sequential: nn.Sequential, sample: Any, device: torch.device, sizes: tuple[int, int],
    min_repeats: int = 5,
) -> CostModel:
    """Every block's costs on micro-batches of the two sample counts ``sizes`` (the smallest and the largest a
    choice will use), each block's input gradient timed apart from its weight gradients: what
    :mod:`lightning_pipe.schedules.choice` predicts every configuration from. ``sample`` is an input of
    ``module``'s forward, tiled or cut along dim 0 to each size. The fastest of ``min_repeats`` runs counts: a
    choice compares the blocks' costs, so a run slowed by another process must not decide it."""
    value = pipelined_input(module, sequential, sample)
    measured = []
    for samples in sizes:
        profiles = profile_blocks(
            sequential, _resized(value, samples), device, min_repeats=min_repeats, split_backward=True
        )
        measured.append([
            BlockCosts(
                samples, p.forward_seconds, p.input_gradient_seconds or 0.0,
                max(0.0, p.backward_seconds - (p.input_gradient_seconds or 0.0)),
                p.activation_bytes, p.input_bytes, p.parameter_bytes,
            )
            for p in profiles
        ])
    return CostModel.measured(*measured)


def _resized(value: Activation, samples: int) -> Activation:
    """``value`` with ``samples`` rows: every tensor of the sample's batch size repeated along dim 0 and cut."""
    tensors = microbatch.as_tensors(value, "the input of the pipelined module")
    batch = tensors[0].shape[0] if tensors and tensors[0].dim() else 0
    if batch == 0:
        raise ValueError("the pipelined module's input has no batch dimension to profile micro-batches of")

    def resized(t: Tensor) -> Tensor:
        if t.dim() == 0 or t.shape[0] != batch:
            return t
        repeats = -(-samples // batch)
        return t.repeat(repeats, *([1] * (t.dim() - 1)))[:samples]

    sized = tuple(resized(t) for t in tensors)
    return sized if isinstance(value, tuple) else sized[0]
