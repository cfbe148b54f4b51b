"""A chunk's forward re-computed in backward: from the same random state and autocast, without updating BatchNorm's
running statistics a second time."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import get_device_states, set_device_states


def recompute_later(
    run: Callable[..., Any], inputs: tuple[Tensor, ...], recomputing: contextlib.AbstractContextManager
) -> tuple[Any, Callable[[], Any]]:
    """``run`` on ``inputs`` without a graph, and what runs it again with one, as ``torch.utils.checkpoint`` would
    in backward: from the same random state, under the same autocast, not updating BatchNorm statistics again.

    Used where a backward is split in two: checkpoint re-computes the forward for each backward call, here once for
    both halves. (``torch.utils.checkpoint.GraphExecGroup`` shares one re-computation between calls only when they
    unpack different saved tensors, which a layer whose input half and weight half read both its input and its
    weight does not.)"""
    devices, device_states = get_device_states(*inputs)
    cpu_state = torch.get_rng_state()
    device_type = next((t.device.type for t in inputs), "cpu")
    autocast = {"device_type": device_type, "enabled": torch.is_autocast_enabled(device_type),
                "dtype": torch.get_autocast_dtype(device_type)}
    with torch.no_grad():
        out = run(*inputs)

    def rerun() -> Any:
        with torch.random.fork_rng(devices=devices, device_type=device_type):
            torch.set_rng_state(cpu_state)
            set_device_states(devices, device_states, device_type=device_type)
            with torch.enable_grad(), torch.autocast(**autocast), recomputing:
                return run(*inputs)

    return out, rerun


@contextlib.contextmanager
def unchanged_running_stats(batch_norms: list[_BatchNorm]) -> Iterator[None]:
    """While open, BatchNorm running statistics may change; they are put back as they were on leaving."""
    saved = [(bn, [buffer.clone() for buffer in bn.buffers()]) for bn in batch_norms]
    try:
        yield
    finally:
        with torch.no_grad():
            for bn, buffers in saved:
                for buffer, value in zip(bn.buffers(), buffers):
                    buffer.copy_(value)
