"""One training step of lightning_pipe's engine without Lightning: what the strategy does per batch, nothing more.

The engine is built as ``GPipeStrategy._partition`` builds it (a :class:`PipelineStage` holding this rank's layers,
:class:`Link` objects to the neighbours, ranks laid out by :class:`PipelineLayout`), and one step is driven as
``GPipeStrategy.backward`` drives it.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_pipe.config import CheckpointMode, PipelineParallelConfig
from lightning_pipe.engine import HandedOff, PipelineEngine
from lightning_pipe.microbatch import Activation
from lightning_pipe.p2p import Link
from lightning_pipe.stage import PipelineStage
from lightning_pipe.topology import PipelineLayout


class EngineStep:
    """This rank's stage of ``sequential`` split over every rank of ``group``, and its training step."""

    def __init__(
        self,
        sequential: nn.Sequential,
        num_micro_batches: int,
        checkpoint: CheckpointMode,
        group: dist.ProcessGroup,
    ) -> None:
        num_stages = dist.get_world_size(group)
        layout = PipelineLayout(num_stages)
        ranks = dist.get_process_group_ranks(group)
        index = layout.stage(dist.get_rank(group))
        ranges = PipelineParallelConfig(num_stages, num_micro_batches).split_into_stages(len(sequential))
        self.stage = PipelineStage(sequential, ranges[index], index, num_stages)

        def link(stage: int) -> Link:
            return Link(ranks[layout.rank(stage)], group, group, next(sequential.parameters()).device)

        previous = link(index - 1) if index > 0 else None
        following = link(index + 1) if index < num_stages - 1 else None
        self.engine = PipelineEngine(
            self.stage, num_micro_batches, checkpoint, previous, following, _no_call_outside_a_step
        )

    def stage_forward(self, x: Tensor) -> Activation | None:
        """The pipelined call of one step on this stage: the joined output on the last stage, else ``None``."""
        engine = self.engine
        with engine.user_step():
            if engine.is_first and not engine.is_last:
                try:
                    engine.forward(x)
                except HandedOff:
                    return None
            if engine.is_last:
                return engine.forward(x)
            engine.relay()
            return None

    def forward(self, x: Tensor, target: Tensor) -> Tensor | None:
        """The forward of every micro-batch; the last stage returns the loss on the joined output."""
        output = self.stage_forward(x)
        return F.mse_loss(output, target) if isinstance(output, Tensor) else None

    def backward(self, loss: Tensor | None) -> None:
        engine = self.engine
        if engine.is_last:
            assert loss is not None
            loss.backward()
            if not engine.is_first:
                engine.finish_last_backward()
        else:
            engine.backward()

    def step(self, x: Tensor, target: Tensor) -> None:
        """Forward and backward of one mini-batch (gradients accumulate in the stage's parameters)."""
        self.backward(self.forward(x, target))


def _no_call_outside_a_step(output: Activation | None) -> Activation:
    raise RuntimeError("the benchmark calls the pipelined module only inside a step")
