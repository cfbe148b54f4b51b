"""The same training step on the peer, ``torch.distributed.pipelining`` (``PipelineStage`` + ``ScheduleGPipe``).

Stage ``s`` runs on rank ``s`` of the group (the peer's own mapping) with the same layers, micro-batch count and
loss as :class:`engine_step.EngineStep`; the peer computes the loss per micro-batch, as its API requires.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from lightning_pipe.partition.counts import PipelineParallelConfig


class PeerStep:
    """This rank's stage of ``sequential`` on torch.distributed.pipelining, and its training step."""

    def __init__(self, sequential: nn.Sequential, num_micro_batches: int, group: dist.ProcessGroup) -> None:
        num_stages = dist.get_world_size(group)
        index = dist.get_rank(group)
        layers = PipelineParallelConfig(num_stages, num_micro_batches).split_into_stages(len(sequential))[index]
        self.module = nn.Sequential(*(sequential[i] for i in layers))
        device = next(sequential.parameters()).device
        stage = PipelineStage(self.module, index, num_stages, device, group=group)
        self.is_first = index == 0
        self.is_loss_stage = index == num_stages - 1
        self.schedule = ScheduleGPipe(stage, num_micro_batches, loss_fn=F.mse_loss)

    def step(self, x: Tensor, target: Tensor) -> None:
        """Forward and backward of one mini-batch (gradients accumulate in the stage's parameters)."""
        args = (x,) if self.is_first else ()
        if self.is_loss_stage:
            self.schedule.step(*args, target=target)
        else:
            self.schedule.step(*args)
