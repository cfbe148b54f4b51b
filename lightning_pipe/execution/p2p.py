"""Asynchronous point-to-point messages between neighbouring stages.

An activation message is a small header (shapes, dtypes, which tensors need gradients) followed by the tensors, so
micro-batches of any shape can flow. Headers travel on a CPU (gloo) group: reading one on the host must not wait on
a GPU stream. Where the tensors travel on that group too (CPU training), the header and the tensors of a micro-batch
whose shapes the receiver could guess go as one message: each message costs both processes CPU time, which the
stage's compute would otherwise have. A gradient message needs no header: the receiver sent the matching activation
and knows its shapes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_pipe.execution.step_agreement import UNCHECKED, StepSignature, decode_signature, encode_signature
from lightning_pipe.reliability.root_cause import PipelineCommunicationError
from lightning_pipe.reliability.stall_rule import Wait
from lightning_pipe.reliability.watchdog import UNWATCHED, StallWatchdog

HEADER_LENGTH = 64
_DATA_TAG = 0
_HEADER_TAG = 1
_RESHAPED_TAG = 2  # a micro-batch's tensors whose shapes differ from the previous micro-batch's (see send_activation)
_GRADIENT_TAG = 3  # gradients flow against the activations, on the same pair of stages with interleaved chunks
_PACKED_TAG = 4  # on a CPU link: a header and its micro-batch's tensors in one message (see `packed_layout`)
PACKED_LIMIT = 1 << 20  # bytes: above, copying the tensors into one message would cost more than a message saves
_ALIGNMENT = 16  # every tensor of a packed message starts at a multiple of this (the largest element size)

# Message kinds (the header's first entry).
ACTIVATION = 1
SKIP = 2  # this step has no pipelined call (e.g. training_step returned before calling the pipelined module)

_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}


@dataclass(frozen=True)
class TensorMeta:
    """What a receiver must know to allocate a tensor before it arrives."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


@dataclass(frozen=True)
class Header:
    """The header of one message: its kind, which micro-batch of how many and for which model chunk, and the tensors
    that follow: the travelling value's, then those of the earlier blocks' outputs ``carried`` with it (each named by
    its block's index and item, ``None`` for the whole output). A step's first message to a stage carries the
    sender's ``step`` too, which the receiver compares with its own (:mod:`lightning_pipe.execution.step_agreement`;
    decoded, :data:`~lightning_pipe.execution.step_agreement.UNCHECKED` where it did not fit)."""

    kind: int
    micro_batch: int = 0
    num_micro_batches: int = 0
    tensors: tuple[TensorMeta, ...] = ()
    is_tuple: bool = False
    chunk: int = 0  # the chunk that receives the tensors as its input
    carried: tuple[tuple[int, int | None], ...] = ()
    step: StepSignature | None | object = None

    def encode(self) -> Tensor:
        """The header as the tensor that travels (read-only: a step sends the same few headers every step, each
        encoded once; a step's first message, which carries the step's signature, is encoded anew)."""
        return _encoded(self) if self.step is None else self._encode()

    def _encode(self) -> Tensor:
        values = [self.kind, self.micro_batch, self.num_micro_batches, self.chunk, int(self.is_tuple), len(self.tensors)]
        values += [len(self.carried), *(n for index, item in self.carried for n in (index, -1 if item is None else item))]
        for meta in self.tensors:
            if meta.dtype not in _DTYPE_CODES:
                names = ", ".join(str(dtype).removeprefix("torch.") for dtype in _DTYPES)
                raise TypeError(
                    f"cannot send a tensor of dtype {meta.dtype} between pipeline stages; they exchange {names}:"
                    " convert it (e.g. with .float()) in the last block of the sending stage."
                )
            values += [_DTYPE_CODES[meta.dtype], int(meta.requires_grad), len(meta.shape), *meta.shape]
        if len(values) < HEADER_LENGTH:
            values += encode_signature(self.step, HEADER_LENGTH - len(values))  # type: ignore[arg-type]
        if len(values) > HEADER_LENGTH:
            raise ValueError(
                f"an activation of {len(self.tensors)} tensors with shapes {[m.shape for m in self.tensors]} does"
                f" not fit the {HEADER_LENGTH}-entry message header; pass fewer or lower-dimensional tensors"
                " between stages."
            )
        header = torch.zeros(HEADER_LENGTH, dtype=torch.int64)
        header[: len(values)] = torch.tensor(values, dtype=torch.int64)
        return header

    @staticmethod
    def decode(header: Tensor) -> Header:
        return _decoded(tuple(header.tolist()))

    @staticmethod
    def _decode(values: tuple[int, ...]) -> Header:
        kind, micro_batch, num_micro_batches, chunk, is_tuple, count, num_carried = values[:7]
        pairs = values[7 : 7 + 2 * num_carried]
        carried = tuple((index, None if item < 0 else item) for index, item in zip(pairs[::2], pairs[1::2]))
        metas, pos = [], 7 + 2 * num_carried
        for _ in range(count):
            dtype_code, requires_grad, ndim = values[pos : pos + 3]
            shape = tuple(values[pos + 3 : pos + 3 + ndim])
            metas.append(TensorMeta(shape, _DTYPES[dtype_code], bool(requires_grad)))
            pos += 3 + ndim
        step = decode_signature(values[pos:]) if pos < HEADER_LENGTH else UNCHECKED  # a full header: no room left
        return Header(kind, micro_batch, num_micro_batches, tuple(metas), bool(is_tuple), chunk, carried, step)


@functools.lru_cache(maxsize=256)  # a step sends the same headers every step: one per micro-batch and chunk
def _encoded(header: Header) -> Tensor:
    return header._encode()


@functools.lru_cache(maxsize=256)
def _decoded(values: tuple[int, ...]) -> Header:
    return Header._decode(values)


@functools.lru_cache(maxsize=64)  # asked for every activation on both ends; a step repeats a few shapes
def packed_layout(metas: tuple[TensorMeta, ...]) -> tuple[tuple[int, ...], int]:
    """Where each tensor of ``metas`` starts in a packed message (in bytes, after the header), and its size."""
    offsets, end = [], HEADER_LENGTH * 8
    for meta in metas:
        end = -(-end // _ALIGNMENT) * _ALIGNMENT
        offsets.append(end)
        end += math.prod(meta.shape) * meta.dtype.itemsize
    return tuple(offsets), end


def _packed_views(message: Tensor, metas: tuple[TensorMeta, ...]) -> tuple[Tensor, ...]:
    """The tensors of ``metas`` as views into the bytes of a packed ``message``."""
    offsets, _ = packed_layout(metas)
    return tuple(
        message[offset : offset + math.prod(meta.shape) * meta.dtype.itemsize].view(meta.dtype).view(meta.shape)
        for offset, meta in zip(offsets, metas)
    )


def _same_shapes(a: tuple[TensorMeta, ...], b: tuple[TensorMeta, ...]) -> bool:
    """Whether two messages need the same receive buffers (whether their tensors need gradients does not matter)."""
    return len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype for x, y in zip(a, b))


class PendingHeader:
    """A header receive posted ahead of time, so that the header arrives while the stage computes. ``posted``: the
    receive of its tensors, where they come in the same message (a packed one, see :meth:`Link.post_packed`)."""

    def __init__(
        self, buffer: Tensor, work: dist.Work, link: Link, micro_batch: int, posted: PostedTensors | None = None
    ) -> None:
        self.buffer = buffer
        self.work = work
        self.link = link
        self.micro_batch = micro_batch
        self.posted = posted

    def wait(self) -> Header:
        link = self.link
        try:
            link.watchdog.wait([self.work], link.awaited("the activation", self.micro_batch), link.meta_group)
        except RuntimeError as error:
            raise link.failure("the activation", self.micro_batch, False, error) from error
        packed = self.posted is not None  # the header is the message's first bytes
        return Header.decode(self.buffer[: HEADER_LENGTH * 8].view(torch.int64) if packed else self.buffer)


@dataclass
class PostedTensors:
    """Receives posted into ``buffers`` for tensors of the shapes ``metas``; valid once ``works`` are waited for."""

    metas: tuple[TensorMeta, ...]
    buffers: tuple[Tensor, ...]
    works: list[dist.Work]


class Link:
    """The connection from this stage to one neighbour: sends and receives of headers and tensors.

    Headers and tensors travel under different tags, so the receive of the next header can be posted before the
    current micro-batch's tensors have arrived. Activation buffers are kept per slot (the caller's choice, e.g. the
    chunk and micro-batch) and reused while the shapes repeat: a slot's previous contents must no longer be needed when
    it is received into again.

    Activations: a receive posted before the sender sends completes as the data arrives, one posted after costs a
    round trip first (gloo hands a message over only once its receive is posted). So the receiver posts micro-batch
    ``m + 1``'s receive before computing ``m``, guessing the shapes of ``m`` (see :meth:`send_activation` for a wrong
    guess). Where headers and tensors share the group (CPU) and the guess is small, that receive is one packed
    message, the header with the tensors (:meth:`packs`).
    """

    def __init__(
        self,
        peer: int,
        data_group: dist.ProcessGroup,
        meta_group: dist.ProcessGroup,
        device: torch.device,
        *,
        stage: int | None = None,
        peer_stage: int | None = None,
        timeout: timedelta | None = None,
        watchdog: StallWatchdog = UNWATCHED,
    ):
        self.peer = peer  # global rank of the neighbour
        self.data_group = data_group
        self.meta_group = meta_group
        self.device = device
        # Who waits on whom, for the error when a wait fails (the groups' timeout ends every wait).
        self.stage, self.peer_stage, self.timeout = stage, peer_stage, timeout
        self.watchdog = watchdog  # bounds every wait on the neighbour during regular training steps
        self._buffers: dict[tuple[Hashable, int], Tensor] = {}  # (slot, position in the message) -> receive buffer
        self._placeholder_cache: dict[tuple[tuple[int, ...], torch.dtype], Tensor] = {}
        self._shares_group = data_group is meta_group and device.type == "cpu"

    def packs(self, expected: tuple[TensorMeta, ...] | None) -> bool:
        """Whether the next activation, whose shapes the receiver guessed as ``expected``, travels as one packed
        message: both ends decide alike from the guess."""
        return self._shares_group and expected is not None and packed_layout(expected)[1] <= PACKED_LIMIT

    def send_header(self, header: Header) -> dist.Work:
        return dist.isend(header.encode(), self.peer, group=self.meta_group, tag=_HEADER_TAG)

    def post_header(self, micro_batch: int = 0) -> PendingHeader:
        """Post the receive of the header that announces ``micro_batch`` (named if the wait for it fails)."""
        buffer = torch.empty(HEADER_LENGTH, dtype=torch.int64)
        work = dist.irecv(buffer, self.peer, group=self.meta_group, tag=_HEADER_TAG)
        return PendingHeader(buffer, work, self, micro_batch)

    def recv_header(self, micro_batch: int = 0) -> Header:
        return self.post_header(micro_batch).wait()

    def send_tensors(self, tensors: tuple[Tensor, ...], tag: int = _DATA_TAG) -> list[dist.Work]:
        return [dist.isend(tensor.contiguous(), self.peer, group=self.data_group, tag=tag) for tensor in tensors]

    def send_gradients(self, gradients: tuple[Tensor, ...]) -> list[dist.Work]:
        """Send the gradients of a micro-batch's activations back to the stage that sent them."""
        return self.send_tensors(gradients, _GRADIENT_TAG)

    def recv_gradients(self, metas: tuple[TensorMeta, ...]) -> tuple[tuple[Tensor, ...], list[dist.Work]]:
        """Post the receive of the gradients of activations of shapes ``metas`` (this stage sent them: no header);
        into fresh buffers, valid once the returned works are waited for."""
        buffers = tuple(torch.empty(meta.shape, dtype=meta.dtype, device=self.device) for meta in metas)
        return buffers, [dist.irecv(b, self.peer, group=self.data_group, tag=_GRADIENT_TAG) for b in buffers]

    def send_activation(
        self, header: Header, tensors: tuple[Tensor, ...], expected: tuple[TensorMeta, ...] | None
    ) -> list[dist.Work]:
        """Send one micro-batch: its header, then its tensors (one packed message where the link :meth:`packs`).

        ``expected``: the shapes the receiver has already posted a receive for (the previous micro-batch's, see
        :meth:`recv_activation`), or ``None`` for a step's first micro-batch. Tensors of those shapes go into that
        receive. Otherwise placeholders of the expected shapes fill it (a packed message: the header alone), and the
        tensors follow under their own tag, into a receive the header lets the receiver post (once per change of
        shapes, e.g. a smaller last micro-batch).
        """
        same = expected is None or _same_shapes(expected, header.tensors)
        if self.packs(expected):  # the receive posted for the guess takes the header and (if it guessed right) the tensors
            works = [self._send_packed(header, tensors if same else (), expected)]
            return works if same else works + self.send_tensors(tensors, _RESHAPED_TAG)
        works = [self.send_header(header)]
        if same:
            return works + self.send_tensors(tensors)
        return works + self.send_tensors(self._placeholders(expected)) + self.send_tensors(tensors, _RESHAPED_TAG)

    def _send_packed(self, header: Header, tensors: tuple[Tensor, ...], expected: tuple[TensorMeta, ...]) -> dist.Work:
        """One message of the layout the receiver posted for ``expected``: the header, then ``tensors`` (none: the
        header alone, the rest of the message unread)."""
        message = torch.empty(packed_layout(expected)[1], dtype=torch.uint8)
        message[: HEADER_LENGTH * 8].view(torch.int64).copy_(header.encode())
        for view, tensor in zip(_packed_views(message, expected), tensors):
            view.copy_(tensor)
        return dist.isend(message, self.peer, group=self.data_group, tag=_PACKED_TAG)

    def send_skip(self, header: Header, expected: tuple[TensorMeta, ...] | None) -> list[dist.Work]:
        """Send a micro-batch's SKIP header. The receiver posted a receive of its tensors ahead of the header, shaped
        as the previous micro-batch's (``expected``): placeholders fill it, so that no receive is left posted to
        catch a later message's tensors."""
        if self.packs(expected):
            assert expected is not None
            return [self._send_packed(header, (), expected)]
        works = [self.send_header(header)]
        return works if expected is None else works + self.send_tensors(self._placeholders(expected))

    def post_packed(self, metas: tuple[TensorMeta, ...], slot: Hashable, micro_batch: int) -> PendingHeader:
        """Post the receive of the next micro-batch as one packed message (see :meth:`packs`), guessing its tensors'
        shapes: its header's receive, whose ``posted`` tensors are valid once the header is."""
        _, size = packed_layout(metas)
        message = self._buffer(slot, -1, TensorMeta((size,), torch.uint8, False))
        work = dist.irecv(message, self.peer, group=self.data_group, tag=_PACKED_TAG)
        return PendingHeader(message, work, self, micro_batch, PostedTensors(metas, _packed_views(message, metas), []))

    def post_activation(self, metas: tuple[TensorMeta, ...], slot: Hashable) -> PostedTensors:
        """Post the receive of the next micro-batch's tensors ahead of its header, guessing their shapes."""
        return self._post(metas, slot, _DATA_TAG)

    def recv_activation(self, header: Header, slot: Hashable, posted: PostedTensors | None) -> PostedTensors:
        """The receive of the tensors ``header`` announces: ``posted`` (see :meth:`post_activation`) if it guessed
        their shapes; else its placeholders are waited for and a receive of the right shapes is posted."""
        if posted is None:
            return self._post(header.tensors, slot, _DATA_TAG)
        if _same_shapes(posted.metas, header.tensors):
            return posted
        self.wait(posted.works, "the placeholder of the activation", header.micro_batch)
        return self._post(header.tensors, slot, _RESHAPED_TAG)

    def _post(self, metas: tuple[TensorMeta, ...], slot: Hashable, tag: int) -> PostedTensors:
        buffers = tuple(self._buffer(slot, position, meta) for position, meta in enumerate(metas))
        works = [dist.irecv(buffer, self.peer, group=self.data_group, tag=tag) for buffer in buffers]
        return PostedTensors(metas, buffers, works)

    def _placeholders(self, metas: tuple[TensorMeta, ...]) -> tuple[Tensor, ...]:
        """Zeros of the given shapes, kept for the next time they are needed."""
        placeholders = []
        for meta in metas:
            key = (meta.shape, meta.dtype)
            if key not in self._placeholder_cache:
                self._placeholder_cache[key] = torch.zeros(meta.shape, dtype=meta.dtype, device=self.device)
            placeholders.append(self._placeholder_cache[key])
        return tuple(placeholders)

    def _buffer(self, slot: Hashable, position: int, meta: TensorMeta) -> Tensor:
        buffer = self._buffers.get((slot, position))
        if buffer is None or buffer.shape != meta.shape or buffer.dtype != meta.dtype:
            buffer = self._buffers[(slot, position)] = torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
        return buffer


    def wait(self, works: list[dist.Work], what: str, micro_batch: int | None = None, sending: bool = False) -> None:
        """Wait for sends to or receives from this neighbour, as long as the stall watchdog allows; a timeout or a lost
        neighbour raises a :class:`PipelineCommunicationError` that names both stages and ``what`` was awaited, a
        stall a :class:`~lightning_pipe.reliability.stall_rule.PipelineStallError` that names the rank that stopped."""
        try:
            self.watchdog.wait(works, self.awaited(what, micro_batch, sending), self.data_group)
        except RuntimeError as error:
            raise self.failure(what, micro_batch, sending, error) from error

    def names(self) -> tuple[str, str]:
        """This stage and the neighbour, ``"stage 1 (rank 0)"``, as errors name them."""
        me = f"stage {self.stage} (rank {dist.get_rank() if dist.is_initialized() else '?'})"
        return me, f"stage {self.peer_stage} (rank {self.peer})"

    def awaited(self, what: str, micro_batch: int | None, sending: bool = False) -> Wait:
        """What a wait on this neighbour is for, as the stall watchdog reports it."""
        return Wait(what if micro_batch is None else f"{what} of micro-batch {micro_batch}", (self.peer,), sending)

    def failure(
        self, what: str, micro_batch: int | None, sending: bool, error: BaseException
    ) -> PipelineCommunicationError:
        """The error for a failed wait on this neighbour: who waited for whom, and for what."""
        me, peer = self.names()
        if micro_batch is not None:
            what = f"{what} of micro-batch {micro_batch}"
        waited = f"waiting for {peer} to receive {what}" if sending else f"waiting for {what} from {peer}"
        return failed_wait(me, waited, peer, self.timeout, error)


def failed_wait(
    me: str, waited: str, peer: str, timeout: timedelta | None, error: BaseException
) -> PipelineCommunicationError:
    """The error for a wait of ``me`` (``waited``: for what, on whom) that timed out, lost ``peer``'s process, or
    failed otherwise (then with the backend's message)."""
    message = str(error).lower()
    if "timed out" in message or "timeout" in message:
        after = f" after {timeout.total_seconds():g} s" if timeout is not None else ""
        return PipelineCommunicationError(
            f"{me} timed out{after} {waited}: {peer} stopped making progress, or is itself waiting for another"
            " stage (see its error). If a step can legitimately take this long, raise GPipeStrategy(timeout=...)."
        )
    if "closed" in message or "reset" in message or "broken pipe" in message:
        return PipelineCommunicationError(
            f"{me} lost {peer} while {waited}: its process ended or closed the connection (it failed or was"
            f" killed; its own error, if any, is printed by that process). ({error})"
        )
    return PipelineCommunicationError(f"{me} failed {waited}: {error}")

