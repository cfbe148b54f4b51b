"""Asynchronous point-to-point messages between neighbouring stages.

An activation message is a small header (shapes, dtypes, which tensors need gradients) followed by the tensors, so
micro-batches of any shape can flow. Headers travel on a CPU (gloo) group: reading one on the host must not wait on
a GPU stream. A gradient message needs no header: the receiver sent the matching activation and knows its shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

HEADER_LENGTH = 64
_DATA_TAG = 0
_HEADER_TAG = 1

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
    """The header of one message: its kind, which micro-batch of how many, and the tensors that follow."""

    kind: int
    micro_batch: int = 0
    num_micro_batches: int = 0
    tensors: tuple[TensorMeta, ...] = ()
    is_tuple: bool = False

    def encode(self) -> Tensor:
        values = [self.kind, self.micro_batch, self.num_micro_batches, int(self.is_tuple), len(self.tensors)]
        for meta in self.tensors:
            if meta.dtype not in _DTYPE_CODES:
                raise TypeError(f"cannot send a tensor of dtype {meta.dtype} between pipeline stages.")
            values += [_DTYPE_CODES[meta.dtype], int(meta.requires_grad), len(meta.shape), *meta.shape]
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
        values = header.tolist()
        kind, micro_batch, num_micro_batches, is_tuple, count = values[:5]
        metas, pos = [], 5
        for _ in range(count):
            dtype_code, requires_grad, ndim = values[pos : pos + 3]
            shape = tuple(values[pos + 3 : pos + 3 + ndim])
            metas.append(TensorMeta(shape, _DTYPES[dtype_code], bool(requires_grad)))
            pos += 3 + ndim
        return Header(kind, micro_batch, num_micro_batches, tuple(metas), bool(is_tuple))


class PendingHeader:
    """A header receive posted ahead of time, so that the header arrives while the stage computes."""

    def __init__(self, buffer: Tensor, work: dist.Work) -> None:
        self.buffer = buffer
        self.work = work

    def wait(self) -> Header:
        self.work.wait()
        return Header.decode(self.buffer)


class Link:
    """The connection from this stage to one neighbour: sends and receives of headers and tensors.

    Headers and tensors travel under different tags, so the receive of the next header can be posted before the
    current micro-batch's tensors have arrived. Receive buffers are kept per slot (the caller's choice, e.g. the
    micro-batch index) and reused while the shapes repeat: a slot's previous contents must no longer be needed when
    it is received into again.
    """

    def __init__(self, peer: int, data_group: dist.ProcessGroup, meta_group: dist.ProcessGroup, device: torch.device):
        self.peer = peer  # global rank of the neighbour
        self.data_group = data_group
        self.meta_group = meta_group
        self.device = device
        self._buffers: dict[tuple[int, int], Tensor] = {}  # (slot, position in the message) -> receive buffer

    def send_header(self, header: Header) -> dist.Work:
        return dist.isend(header.encode(), self.peer, group=self.meta_group, tag=_HEADER_TAG)

    def post_header(self) -> PendingHeader:
        buffer = torch.empty(HEADER_LENGTH, dtype=torch.int64)
        return PendingHeader(buffer, dist.irecv(buffer, self.peer, group=self.meta_group, tag=_HEADER_TAG))

    def recv_header(self) -> Header:
        return self.post_header().wait()

    def send_tensors(self, tensors: tuple[Tensor, ...]) -> list[dist.Work]:
        return [dist.isend(tensor.contiguous(), self.peer, group=self.data_group, tag=_DATA_TAG) for tensor in tensors]

    def recv_tensors(
        self, metas: tuple[TensorMeta, ...], slot: int | None = None
    ) -> tuple[tuple[Tensor, ...], list[dist.Work]]:
        """Post receives; the buffers are valid once the returned works are waited on.

        With a ``slot`` the buffers of that slot's previous receive are reused if the shapes match, else fresh ones
        are kept for the next time; without one, fresh buffers are returned and not kept.
        """
        buffers = tuple(self._buffer(slot, position, meta) for position, meta in enumerate(metas))
        return buffers, [dist.irecv(buffer, self.peer, group=self.data_group, tag=_DATA_TAG) for buffer in buffers]

    def _buffer(self, slot: int | None, position: int, meta: TensorMeta) -> Tensor:
        if slot is None:
            return torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
        buffer = self._buffers.get((slot, position))
        if buffer is None or buffer.shape != meta.shape or buffer.dtype != meta.dtype:
            buffer = self._buffers[(slot, position)] = torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
        return buffer


def wait_all(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()
