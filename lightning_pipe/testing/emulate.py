"""Emulated devices: blocks whose forward, input gradient and weight gradient each take a set time on almost no CPU.

Build a model of them, train it with ``Trainer(strategy="gpipe", devices=N)`` on CPU processes, and a schedule's
step takes what it would take on ``N`` accelerators with those kernel times, whatever the host's cores::

    from lightning_pipe.testing.emulate import BlockTimes, emulated_blocks

    uniform = BlockTimes(forward=0.05, input_gradient=0.05, weight_gradient=0.05)   # seconds
    heavy_head = BlockTimes(forward=0.10, input_gradient=0.10, weight_gradient=0.10)
    model.blocks = emulated_blocks(width=256, times=[uniform] * 7 + [heavy_head])     # 8 blocks, the last twice as heavy

Each part of a block's work is a wait that releases the GIL and the core, as a kernel on an accelerator leaves the
host free; what the host does around it (the runtime's own cost per action, its messages) is real and shows. The
waits end at their set time on average: each asks the operating system for its usual lateness less. The
block is ``x * weight + bias`` (``weight`` and ``bias`` of ``width`` elements) so it trains; its output, the
activation that travels to the next stage, has its input's shape: choose the batch and ``width`` for the size.

The input gradient and the weight gradient are separate autograd nodes::

    x ──── input path (forward: F; backward: I) ────┐
                                                     + ── output
    weight, bias ── weight path (backward: W) ──────┘

so a split backward (:mod:`lightning_pipe.execution.split_backward`, and torch.distributed.pipelining's) that takes
the input gradient first runs only the input path, and the weight half later runs only the weight path: a schedule
that defers weight gradients really defers their time. A plain ``backward()`` runs both, ``I + W``. Waits are skipped
on the meta device, where the strategy only infers shapes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class BlockTimes:
    """Seconds that one call of a block takes for one micro-batch: its forward, the gradient of its input, and the
    gradients of its weight and bias. A full backward takes ``input_gradient + weight_gradient``."""

    forward: float
    input_gradient: float
    weight_gradient: float

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
                raise ValueError(
                    f"BlockTimes({field.name}={value!r}): each time is a finite number of seconds, 0 or more"
                    f" (for example {field.name}=0.05 for 50 ms)"
                )

    def scaled(self, factor: float) -> BlockTimes:
        """These times ``factor`` times as long (a block twice as heavy: ``scaled(2)``)."""
        return BlockTimes(self.forward * factor, self.input_gradient * factor, self.weight_gradient * factor)


class EmulatedBlock(nn.Module):
    """``x * weight + bias`` over the last dimension (``width``), taking ``times`` per micro-batch (see the module's
    docstring): real parameters, a real activation, the waits of an accelerator's kernels."""

    def __init__(self, width: int, times: BlockTimes) -> None:
        super().__init__()
        if not isinstance(width, int) or isinstance(width, bool) or width < 1:
            raise ValueError(f"EmulatedBlock(width={width!r}): width is the size of the input's last dimension, 1 or more")
        if not isinstance(times, BlockTimes):
            raise TypeError(
                f"EmulatedBlock(times={times!r}): pass a BlockTimes, for example"
                " BlockTimes(forward=0.05, input_gradient=0.05, weight_gradient=0.05)"
            )
        self.times = times
        # Near 1 and 0, with a little spread, so that a deep stack neither vanishes nor explodes while it trains.
        generator = torch.Generator().manual_seed(width)
        self.weight = nn.Parameter(1 + 0.01 * torch.randn(width, generator=generator))
        self.bias = nn.Parameter(0.01 * torch.randn(width, generator=generator))

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1:] != self.weight.shape:
            raise ValueError(
                f"EmulatedBlock of width {self.weight.numel()} got an input of shape {tuple(x.shape)}: its last"
                f" dimension must be {self.weight.numel()}; build the block with width={x.shape[-1]} or reshape the input"
            )
        through_input = _InputPath.apply(x, self.weight.detach(), self.bias.detach(), self.times)
        return through_input + _WeightPath.apply(x.detach(), self.weight, self.bias, self.times)

    def extra_repr(self) -> str:
        t = self.times
        return (
            f"width={self.weight.numel()}, forward={t.forward * 1e3:g} ms, input_gradient={t.input_gradient * 1e3:g} ms,"
            f" weight_gradient={t.weight_gradient * 1e3:g} ms"
        )


def emulated_blocks(width: int, times: Sequence[BlockTimes]) -> nn.Sequential:
    """One :class:`EmulatedBlock` of ``width`` per entry of ``times``, in a Sequential the strategy can pipeline."""
    if not times:
        raise ValueError("emulated_blocks(times=[]): give one BlockTimes per block, at least one")
    return nn.Sequential(*(EmulatedBlock(width, t) for t in times))


class _InputPath(torch.autograd.Function):
    """The forward (``forward`` seconds) and the input's gradient (``input_gradient`` seconds)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor, times: BlockTimes) -> Tensor:
        started = time.perf_counter()
        ctx.save_for_backward(weight)
        ctx.times = times
        output = x * weight + bias
        _wait(started, times.forward, x)
        return output

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        started = time.perf_counter()
        (weight,) = ctx.saved_tensors
        grad_input = grad * weight
        _wait(started, ctx.times.input_gradient, grad)
        return grad_input, None, None, None


class _WeightPath(torch.autograd.Function):
    """The weight and bias's share of the output (zero: the input path computed it) and their gradients
    (``weight_gradient`` seconds)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor, times: BlockTimes) -> Tensor:
        ctx.save_for_backward(x)
        ctx.times = times
        return torch.zeros_like(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor, Tensor, None]:
        started = time.perf_counter()
        (x,) = ctx.saved_tensors
        leading = tuple(range(grad.dim() - 1))
        grad_weight, grad_bias = (grad * x).sum(leading), grad.sum(leading)
        _wait(started, ctx.times.weight_gradient, grad)
        return None, grad_weight, grad_bias, None


class _Lateness:
    """How late ``time.sleep`` wakes up in this process, on average over the recent waits (0.1-0.2 ms on a loaded
    Linux host): each wait asks for that much less, so that waits end at their set time on average, as a kernel
    would. Without it, every one of a step's dozens of waits would add the operating system's lateness to the
    measured step, and the runtimes' own cost would drown in it. At most :attr:`MOST` of a wait is taken off: after a
    burst of the machine's load (milliseconds late, for a while in the average) a wait must not end far before its
    set time."""

    WEIGHT = 0.1  # of the latest wait in the average
    MOST = 0.05  # of a wait: the usual lateness fits (0.2 ms of the benchmarks' shortest waits, 4 ms)

    def __init__(self) -> None:
        self.seconds = 0.0

    def sleep(self, seconds: float) -> None:
        asked = seconds - min(self.seconds, self.MOST * seconds)
        start = time.perf_counter()
        time.sleep(asked)
        self.seconds += self.WEIGHT * (time.perf_counter() - start - asked - self.seconds)


_LATENESS = _Lateness()


def _wait(started: float, seconds: float, tensor: Tensor) -> None:
    """Sleep until ``seconds`` after ``started`` (the arithmetic done counts), releasing the GIL; not on meta."""
    if tensor.is_meta:
        return
    remaining = started + seconds - time.perf_counter()
    if remaining > 0:
        _LATENESS.sleep(remaining)
