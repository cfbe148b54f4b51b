"""Emulated devices (``lightning_pipe.testing.emulate``): each part of a block's work takes its set time on almost no CPU, the
weight gradients' time goes where a split backward puts them, and the block computes ``x * weight + bias`` exactly.

Times are checked as the quickest of a few repetitions, within 10% of the set time: a wait asks the operating system
for its usual lateness less, never more than 5% of the wait, so none ends earlier than that, and the machine's other
work only ever makes a wait later. Training through the strategy is checked in
tests/test_schedules_fit.py (runs ``emulated_*``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import torch

from lightning_pipe.testing import emulate
from lightning_pipe.testing.emulate import BlockTimes, EmulatedBlock, emulated_blocks
from lightning_pipe.execution.split_backward import backward_input

REPEATS = 7
WIDTH, ROWS = 64, 32


def typical(run: Callable[[], object], prepare: Callable[[], object] = lambda: None) -> tuple[float, float]:
    """The quickest wall time of ``REPEATS`` calls of ``run`` (each after ``prepare``), and the CPU time of them all
    over their wall time."""
    walls, cpu, wall_total = [], 0.0, 0.0
    for _ in range(REPEATS):
        prepared = prepare()
        cpu_start, start = time.process_time(), time.perf_counter()
        run(prepared) if prepared is not None else run()
        walls.append(time.perf_counter() - start)
        cpu += time.process_time() - cpu_start
        wall_total += walls[-1]
    return min(walls), cpu / wall_total


def test_forward_input_and_weight_gradients_each_take_their_set_time_on_little_cpu():
    times = BlockTimes(forward=0.03, input_gradient=0.02, weight_gradient=0.05)
    block = EmulatedBlock(WIDTH, times)
    x = torch.randn(ROWS, WIDTH, requires_grad=True)

    forward, forward_cpu = typical(lambda: block(x))
    # Input gradient alone: autograd.grad with respect to the input runs the input path only.
    input_half, input_cpu = typical(lambda y: torch.autograd.grad(y, x, torch.ones_like(y)), lambda: block(x))
    weight_half, weight_cpu = typical(
        lambda y: torch.autograd.grad(y, [block.weight, block.bias], torch.ones_like(y)), lambda: block(x)
    )
    full, _ = typical(lambda y: y.backward(torch.ones_like(y)), lambda: block(x))

    assert 0.9 * times.forward <= forward <= 1.1 * times.forward
    assert 0.9 * times.input_gradient <= input_half <= 1.1 * times.input_gradient
    assert 0.9 * times.weight_gradient <= weight_half <= 1.1 * times.weight_gradient
    both = times.input_gradient + times.weight_gradient
    assert 0.9 * both <= full <= 1.1 * both
    # The waits leave the core free (as a kernel on an accelerator leaves the host): a fraction of the wall time.
    assert max(forward_cpu, input_cpu, weight_cpu) < 0.3


def test_a_burst_of_lateness_shortens_a_wait_by_at_most_its_cap(monkeypatch):
    """After a burst of the machine's load the average lateness is milliseconds: the waits that follow ask for at most
    ``_Lateness.MOST`` of their time less, so none ends far before its set time (a CI run once measured 16 ms for 20)."""
    lateness = emulate._Lateness()
    monkeypatch.setattr(emulate, "_LATENESS", lateness)
    times = BlockTimes(forward=0.02, input_gradient=0.0, weight_gradient=0.0)
    block = EmulatedBlock(WIDTH, times)
    x = torch.randn(ROWS, WIDTH)
    for _ in range(REPEATS):
        lateness.seconds = 0.004  # 20% of the wait
        start = time.perf_counter()
        block(x)
        assert time.perf_counter() - start >= (1 - lateness.MOST) * times.forward


def test_split_backward_runs_the_input_gradients_first_and_defers_the_weight_gradients_time():
    times = BlockTimes(forward=0.0, input_gradient=0.02, weight_gradient=0.04)
    chunk = emulated_blocks(WIDTH, [times] * 3)
    x = torch.randn(ROWS, WIDTH, requires_grad=True)
    weights = list(chunk.parameters())

    def input_half(y):
        return backward_input([y], [torch.ones_like(y)], [x], weights)[1]

    input_time, _ = typical(input_half, lambda: chunk(x))
    weight_time, _ = typical(lambda later: later.compute(), lambda: input_half(chunk(x)))
    assert 0.9 * 3 * times.input_gradient <= input_time <= 1.1 * 3 * times.input_gradient  # no weight gradient in it
    assert 0.9 * 3 * times.weight_gradient <= weight_time <= 1.1 * 3 * times.weight_gradient


def test_the_block_computes_a_scale_and_shift_with_exact_gradients_through_a_split_backward():
    chunk = emulated_blocks(WIDTH, [BlockTimes(0, 0, 0)] * 2)
    reference = [(block.weight.detach().clone().requires_grad_(), block.bias.detach().clone().requires_grad_())
                 for block in chunk]
    x = torch.randn(ROWS, WIDTH, requires_grad=True)
    x_reference = x.detach().clone().requires_grad_()
    expected = x_reference
    for weight, bias in reference:
        expected = expected * weight + bias
    grad = torch.randn(ROWS, WIDTH)
    expected.backward(grad)

    output = chunk(x)
    assert torch.allclose(output, expected)
    (grad_x,), later = backward_input([output], [grad], [x], list(chunk.parameters()))
    assert all(p.grad is None for p in chunk.parameters())  # every weight gradient deferred
    later.compute()
    assert torch.allclose(grad_x, x_reference.grad)
    for block, (weight, bias) in zip(chunk, reference):
        assert torch.allclose(block.weight.grad, weight.grad) and torch.allclose(block.bias.grad, bias.grad)


def test_the_meta_device_infers_shapes_without_waiting():
    block = EmulatedBlock(WIDTH, BlockTimes(forward=1.0, input_gradient=1.0, weight_gradient=1.0)).to("meta")
    start = time.perf_counter()
    output = block(torch.empty(ROWS, WIDTH, device="meta"))
    assert output.shape == (ROWS, WIDTH) and time.perf_counter() - start < 0.5


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: BlockTimes(forward=-0.01, input_gradient=0, weight_gradient=0), r"forward=-0.01\): each time is a"),
        (lambda: BlockTimes(forward=0, input_gradient=float("nan"), weight_gradient=0), "input_gradient=nan"),
        (lambda: EmulatedBlock(0, BlockTimes(0, 0, 0)), r"width=0\): width is the size of the input's last"),
        (lambda: EmulatedBlock(4, 0.05), "pass a BlockTimes"),
        (lambda: EmulatedBlock(4, BlockTimes(0, 0, 0))(torch.zeros(2, 5)), "build the block with width=5"),
        (lambda: emulated_blocks(4, []), "one BlockTimes per block"),
    ],
)
def test_bad_settings_are_refused_with_the_fix(make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make()
