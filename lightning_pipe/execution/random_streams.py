"""Random streams of their own: each stage's blocks draw each micro-batch's randomness (dropout) from a seeded stream.

Every stage starts a step from the same random state (the last stage's, adopted after each step: see
:mod:`lightning_pipe.execution.replayed_logs`), so that data order and the random numbers of the user's step agree across stages.
Drawn from that shared state, blocks on different stages would draw the same numbers: a ``Dropout`` on stage 0 and
one on stage 1 would drop the same elements at every step. With more than one stage, each micro-batch's forward on
a stage therefore runs with the generators seeded by :func:`micro_batch_seed`, and restored after, so the blocks
neither read nor advance the shared stream. The seed is fixed when the forward first runs: re-computing the forward
in backward (``torch.utils.checkpoint``) re-seeds alike and draws the same mask.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch

# Seeds are drawn from [0, 2**63): what `torch.manual_seed` accepts on every device.
_SEED_BITS = 63
T = TypeVar("T")


def hashed_seed(text: bytes) -> int:
    """A seed for ``torch.manual_seed`` from ``text``: the first 63 bits of its SHA-256, so that texts that differ
    in any way give unrelated random streams."""
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> (64 - _SEED_BITS)


def micro_batch_seed(shared_state: bytes, step: int, replica: int, stage: int, micro_batch: int) -> int:
    """The seed of micro-batch ``micro_batch``'s stream on ``stage`` of data-parallel ``replica`` in the ``step``-th
    step (counted from the start of the trainer function), whose start found the shared random generator in
    ``shared_state``: unrelated streams for any two micro-batches, stages, replicas or steps."""
    return hashed_seed(shared_state + f"/{step}/{replica}/{stage}/{micro_batch}".encode())


@contextmanager
def seeded(device: torch.device, seed: int) -> Iterator[None]:
    """The default random generators of the CPU and of ``device`` seeded with ``seed``; their states restored after,
    so that what runs inside neither depends on nor disturbs the global random stream."""
    if device.type in ("cpu", "meta"):
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)
            yield
        return
    backend = torch.get_device_module(device.type)
    index = device.index if device.index is not None else backend.current_device()
    with torch.random.fork_rng(devices=[index], device_type=device.type), backend.device(index):
        torch.default_generator.manual_seed(seed)
        backend.manual_seed(seed)  # the current device's generator: this stage's
        yield


class StageRandomStreams:
    """The streams of this rank's stage: :meth:`begin_step` at the start of each step, then :meth:`seeded_run` for
    each micro-batch's forward. Used only with more than one stage: one stage draws from the global stream, as one
    device does."""

    def __init__(self, device: torch.device, stage: int, replica: int) -> None:
        self.device = device
        self.stage = stage
        self.replica = replica
        self._steps = 0
        self._shared_state = b""

    def begin_step(self) -> None:
        """Note the shared random state this step starts from (equal on every stage); it is read, not advanced."""
        self._shared_state = torch.random.get_rng_state().numpy().tobytes()
        self._steps += 1

    def seeded_run(self, run: Callable[..., T], micro_batch: int, chunk: int | None = None) -> Callable[..., T]:
        """``run`` under micro-batch ``micro_batch``'s stream in this step, with the same seed every time it runs;
        with virtual stages, each model ``chunk`` has streams of its own (one chunk per stage: the stage's)."""
        chunk = self.stage if chunk is None else chunk
        seed = micro_batch_seed(self._shared_state, self._steps, self.replica, chunk, micro_batch)

        def on_own_stream(*args: object) -> T:
            with seeded(self.device, seed):
                return run(*args)

        return on_own_stream
