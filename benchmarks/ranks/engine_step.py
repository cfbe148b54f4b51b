"""One training step of lightning_pipe's runtime without Lightning: what the strategy does per batch, nothing more.

The stage is built as ``GPipeStrategy._partition`` builds it (:class:`StageBlocks` running this rank's blocks of the Sequential, the
groups of :func:`init_pipeline_groups`, a :class:`PipelineEngine` running the GPipe schedule, a
:class:`StageRuntime` playing this rank's role), and one step is driven as ``GPipeStrategy.backward`` drives it.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_pipe.config import PipelineParallelConfig
from lightning_pipe.engine import PipelineEngine
from lightning_pipe.groups import init_pipeline_groups
from lightning_pipe.microbatch import Activation
from lightning_pipe.runtime import StageRuntime
from lightning_pipe.schedule import SCHEDULES
from lightning_pipe.settings import RecomputeMode
from lightning_pipe.region import container_region
from lightning_pipe.stage import StageBlocks
from lightning_pipe.topology import PipelineLayout


class EngineStep:
    """This rank's stage of ``sequential`` split over every rank of the (initialised) default group, and its step."""

    def __init__(self, sequential: nn.Sequential, num_micro_batches: int, checkpoint: RecomputeMode) -> None:
        num_stages = dist.get_world_size()
        device = next(sequential.parameters()).device
        groups = init_pipeline_groups(
            PipelineLayout(num_stages), dist.get_rank(), device, dist.get_backend(), None, ("pp", "dp")
        )
        index = groups.stage
        ranges = PipelineParallelConfig(num_stages, num_micro_batches).split_into_stages(len(sequential))
        self.sequential, holder = sequential, nn.ModuleDict({"pipelined": sequential})
        self.stage = StageBlocks(holder, container_region(holder, "pipelined"), ranges[index], index, num_stages)
        self.stage.install()
        self.engine = PipelineEngine(
            self.stage, num_micro_batches, checkpoint,
            previous=groups.link(index - 1) if not groups.is_first else None,
            next=groups.link(index + 1) if not groups.is_last else None,
            schedule=SCHEDULES["gpipe"],
        )
        self.runtime = StageRuntime(groups, self.engine, self.stage)

    def stage_forward(self, x: Tensor) -> Activation | None:
        """The pipelined call of one step on this stage: the joined output on the last stage, else ``None``."""
        return self.runtime.forward_step(lambda: self.sequential(x))

    def forward(self, x: Tensor, target: Tensor) -> Tensor | None:
        """The forward of every micro-batch; the last stage returns the loss on the joined output."""
        output = self.stage_forward(x)
        return F.mse_loss(output, target) if isinstance(output, Tensor) else None

    def backward(self, loss: Tensor | None) -> None:
        runtime = self.runtime
        if runtime.holds_loss:
            assert loss is not None
            loss.backward()
        else:
            runtime.backward_from_next_stage()
        runtime.end_backward()

    def step(self, x: Tensor, target: Tensor) -> None:
        """Forward and backward of one mini-batch (gradients accumulate in the stage's parameters)."""
        self.backward(self.forward(x, target))
