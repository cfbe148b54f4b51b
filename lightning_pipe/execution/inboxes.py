"""The messages one stage receives from another in a step, taken in the order this stage's schedule takes them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist
from torch import Tensor

from lightning_pipe.execution.p2p import SKIP, Header, Link, PendingHeader, PostedTensors
from lightning_pipe.execution.step_agreement import PipelineMismatchError, StepSignature, check_same_step

__all__ = ["ActivationInbox", "GradientInbox", "Key", "PipelineMismatchError"]

Key = tuple[int, int]  # (chunk, micro-batch)


class ActivationInbox:
    """The activations one stage sends to this one in a step, in the order this stage's schedule takes them.

    The next message's header and tensors are received while this stage computes: their receives are posted when
    the current one is taken, the tensors' with its shapes (the sender corrects a wrong guess, see
    :meth:`Link.send_activation`), as one packed message where the link packs them. Each (chunk, micro-batch) is
    received into buffers of its own, reused from step to step. The step's first message says which step the sender
    runs, on which batch: unless it is this stage's ``step`` (``None``: not in a step), nothing of it is used (see
    :mod:`lightning_pipe.execution.step_agreement`).
    """

    def __init__(self, link: Link, expected: Callable[[], list[Key]], step: StepSignature | None = None) -> None:
        self.link = link
        self._expected = expected
        self._step = step  # compared with the first message's, then None
        self._order: list[Key] | None = None
        self._index = 0
        self._header: Header | None = None  # the next message's, when read ahead
        self._pending: PendingHeader | None = None
        self._posted: PostedTensors | None = None

    def first_header(self) -> Header:
        """The next message's header, before it is taken: a step's first tells the count of micro-batches."""
        if self._header is None:
            self._header = self._pending.wait() if self._pending is not None else self.link.recv_header()
            self._pending = None
            if self._step is not None:
                check_same_step(self._step, self._header.step, *self.link.names())
                self._step = None
        return self._header

    def take(self, k: int, m: int) -> tuple[Header, tuple[Tensor, ...]]:
        if self._order is None:
            self._order = self._expected()
        link = self.link
        header, self._header = self.first_header(), None
        if header.kind == SKIP:
            self._check(header, k, m)
            if self._posted is not None:  # the sender filled the receive posted ahead with placeholders
                link.wait(self._posted.works, "the placeholder of a skipped micro-batch", m)
            self._advance(None)
            return header, ()
        received = link.recv_activation(header, (k, m), self._posted)
        self._check(header, k, m)
        self._advance(header)
        link.wait(received.works, "the activation", m)
        return header, received.buffers

    def _advance(self, header: Header | None) -> None:
        """Post the next message's receives, guessing its shapes from this one's."""
        assert self._order is not None
        self._index += 1
        self._pending = self._posted = None
        if self._index < len(self._order):
            following = self._order[self._index]
            guess = header.tensors if header is not None else None
            if self.link.packs(guess):
                assert guess is not None
                self._pending = self.link.post_packed(guess, following, following[1])
                self._posted = self._pending.posted
                return
            self._pending = self.link.post_header(following[1])
            if guess is not None:
                self._posted = self.link.post_activation(guess, following)

    def _check(self, header: Header, k: int, m: int) -> None:
        if (header.chunk, header.micro_batch) != (k, m):
            raise PipelineMismatchError(
                f"stage {self.link.stage} expected the input of chunk {k} for micro-batch {m} from stage"
                f" {self.link.peer_stage}, which sent chunk {header.chunk}'s for micro-batch {header.micro_batch}:"
                " the stages run different schedules or different micro-batch counts."
            )


class GradientInbox:
    """The gradients one stage sends back to this one in a step, in the order this stage's schedule takes them; the
    next one's receive is posted when the current one is taken, if its forward has run (its shapes are known)."""

    def __init__(self, link: Link, order: list[Key]) -> None:
        self.link = link
        self._order = order
        self._index = 0
        self._posted: tuple[tuple[Tensor, ...], list[dist.Work]] | None = None

    def take(self, k: int, m: int, micro_batches: Mapping[Key, Any]) -> tuple[Tensor, ...]:
        """(chunk ``k``, micro-batch ``m``)'s gradients; ``micro_batches``: those in flight, each with the
        ``output_metas`` its gradients are received as."""
        while self._order[self._index] != (k, m):  # skipped micro-batches send no gradient
            assert self._order[self._index] not in micro_batches
            self._index += 1
        if self._posted is None:
            self._posted = self.link.recv_gradients(micro_batches[(k, m)].output_metas)
        (tensors, works), self._posted = self._posted, None
        self._index += 1
        if self._index < len(self._order) and self._order[self._index] in micro_batches:
            self._posted = self.link.recv_gradients(micro_batches[self._order[self._index]].output_metas)
        self.link.wait(works, "the gradient", m)
        return tensors
