"""Gradient reductions across processes, before the optimizer step.

Two reductions, both once per optimizer step (after gradient accumulation, like DDP's ``no_sync``):

* over the stages of a pipeline, a parameter held by every stage (an embedding before the pipelined module, a head
  after it) sums each stage's contribution;
* over the data-parallel replicas of a stage, every parameter averages the replicas' gradients.

A parameter that no participating process used keeps ``grad=None``, as on one device, so optimizers skip it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def reduce_gradients(parameters: list[nn.Parameter], group: dist.ProcessGroup, average: bool) -> None:
    """Sum (or average) the gradients of ``parameters`` over ``group``, in one flat all-reduce."""
    if not parameters or dist.get_world_size(group) == 1:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
    used = torch.tensor([float(p.grad is not None) for p in parameters], device=grads[0].device)
    flat = torch.cat([g.reshape(-1) for g in grads] + [used.to(grads[0].dtype)])
    dist.all_reduce(flat, group=group)
    if average:
        flat[: flat.numel() - len(parameters)] /= dist.get_world_size(group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    for p, g, users in zip(parameters, grads, flat[offset:].tolist()):
        p.grad = g if users > 0 else None
