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


class Link:
    """The connection from this stage to one neighbour: sends and receives of headers and tensors."""

    def __init__(self, peer: int, data_group: dist.ProcessGroup, meta_group: dist.ProcessGroup, device: torch.device):
        self.peer = peer  # global rank of the neighbour
        self.data_group = data_group
        self.meta_group = meta_group
        self.device = device

    def send_header(self, header: Header) -> dist.Work:
        return dist.isend(header.encode(), self.peer, group=self.meta_group)

    def recv_header(self) -> Header:
        buffer = torch.empty(HEADER_LENGTH, dtype=torch.int64)
        dist.recv(buffer, self.peer, group=self.meta_group)
        return Header.decode(buffer)

    def send_tensors(self, tensors: tuple[Tensor, ...]) -> list[dist.Work]:
        return [dist.isend(tensor.contiguous(), self.peer, group=self.data_group) for tensor in tensors]

    def recv_tensors(self, metas: tuple[TensorMeta, ...]) -> tuple[tuple[Tensor, ...], list[dist.Work]]:
        """Post receives into fresh buffers; the buffers are valid once the returned works are waited on."""
        buffers = tuple(torch.empty(m.shape, dtype=m.dtype, device=self.device) for m in metas)
        return buffers, [dist.irecv(buffer, self.peer, group=self.data_group) for buffer in buffers]


def wait_all(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()
