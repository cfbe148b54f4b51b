"""One training step of lightning_pipe's runtime without Lightning: what the strategy does per batch, nothing more.

The stage is built as ``GPipeStrategy._partition`` builds it (:class:`StageBlocks` holding this rank's chunks of the
Sequential, the groups of :func:`init_pipeline_groups`, a :class:`PipelineEngine` running the schedule, a
:class:`StageRuntime` playing this rank's role), and one step is driven as the strategy drives it: a whole-batch step
(GPipe) as ``GPipeStrategy.training_step`` then ``backward``, a per-micro-batch step as ``training_step``.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.plugins.precision import Precision
from torch import Tensor, nn

from lightning_pipe.partition.counts import PipelineParallelConfig
from lightning_pipe.execution.engine import PipelineEngine
from lightning_pipe.execution.process_groups import PipelineGroups, init_pipeline_groups
from lightning_pipe.execution.runtime import StageRuntime
from lightning_pipe.execution.stage import StageBlocks
from lightning_pipe.execution.steps import MicroBatchStep, training_step_for
from lightning_pipe.partition.microbatch import Activation
from lightning_pipe.partition.region import container_region
from lightning_pipe.partition.topology import PipelineLayout
from lightning_pipe.schedules.actions import PipelineSchedule
from lightning_pipe.schedules.builtin import SCHEDULES
from lightning_pipe.settings import RecomputeMode
from lightning_pipe.trace.timeline import StepTimeline


_NO_PRECISION = Precision()  # full precision: no autocast, no gradient scaler

# One set of groups per layout for all the steps a launch builds (dozens, taking turns): every gloo group keeps
# threads that wake up while idle, about 1 ms of CPU per second each, which would otherwise pile up in every step's
# CPU time (ours and torch's alike, hiding the runtimes' own difference) and take a share of the machine's cores.
_GROUPS: dict[PipelineLayout, PipelineGroups] = {}


class _MeanSquaredError(LightningModule):
    """The user's module of a step: the pipelined Sequential and a mean-squared-error loss."""

    def __init__(self, sequential: nn.Sequential) -> None:
        super().__init__()
        self.pipelined = sequential

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, target = batch
        return F.mse_loss(self.pipelined(x), target)


class EngineStep:
    """This rank's stage of ``sequential`` split over every rank of the (initialised) default group, and its step."""

    def __init__(
        self,
        sequential: nn.Sequential,
        num_micro_batches: int,
        checkpoint: RecomputeMode,
        schedule: str | PipelineSchedule = "gpipe",
        virtual_stages: int | None = None,
        timeline: StepTimeline | None = None,
    ) -> None:
        num_stages = dist.get_world_size()
        schedule = SCHEDULES[schedule] if isinstance(schedule, str) else schedule
        v = schedule.checked_virtual_stages(virtual_stages)
        device = next(sequential.parameters()).device
        layout = PipelineLayout(num_stages, loss_on_first_stage=num_stages > 1 and schedule.loss_stage(num_stages, v) == 0)
        groups = _GROUPS.get(layout)
        if groups is None:
            groups = _GROUPS[layout] = init_pipeline_groups(layout, dist.get_rank(), device, dist.get_backend(), None)
        index = groups.stage
        chunks = PipelineParallelConfig(num_stages * v, num_micro_batches).split_into_stages(len(sequential))
        self.module = _MeanSquaredError(sequential)
        local = {k: chunks[k] for k in schedule.chunks(index, num_stages, v)}
        self.stage = StageBlocks(
            self.module, container_region(self.module, "pipelined"), local, index, num_stages, num_chunks=len(chunks)
        )
        self.stage.install()
        self.engine = PipelineEngine(
            self.stage, num_micro_batches, checkpoint,
            links={peer: groups.link(peer) for peer in schedule.neighbours(index, num_stages, v)},
            schedule=schedule, virtual_stages=v, timeline=timeline,
        )
        self.runtime = StageRuntime(groups, self.engine, self.stage)
        self.training = training_step_for(self.runtime)

    def stage_forward(self, x: Tensor) -> Activation | None:
        """The pipelined call of one whole-batch step on this stage: the joined output on the last stage."""
        return self.runtime.forward_step(lambda: self.module.pipelined(x))

    def step(self, x: Tensor, target: Tensor) -> None:
        """Forward and backward of one mini-batch (gradients accumulate in the stage's parameters)."""
        if isinstance(self.training, MicroBatchStep):
            self.training.run(self.module, _NO_PRECISION, ((x, target), 0), {})
            return
        self.backward(self.stage_forward(x), target)

    def backward(self, output: Activation | None, target: Tensor) -> None:
        """The backward of a whole-batch step whose forward returned ``output``."""
        if self.runtime.is_loss_stage:
            F.mse_loss(output, target).backward()  # to the leaves of the blocks' output
        self.engine.backward_phase()
