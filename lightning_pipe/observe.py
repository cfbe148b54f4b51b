"""Watching the pipeline during training: which steps' timelines are gathered, and the bubble sent to the loggers.

Gathering a step's timeline from every stage is a collective over the pipeline, so it happens only for the training
steps that Lightning logs (every ``log_every_n_steps``, as its own monitors do) or that ``trace_steps`` names. The
timelines themselves, the trace file and the bubble arithmetic live in :mod:`lightning_pipe.trace`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist
from lightning.pytorch import Trainer

from lightning_pipe.timeline import StepTimeline

if TYPE_CHECKING:  # imported when tracing starts, so that `python -m lightning_pipe.trace` finds it unimported
    from lightning_pipe.trace import PipelineTracer, StepObservation


def make_tracer(
    timeline: StepTimeline,
    group: dist.ProcessGroup | None,
    stage: int,
    num_stages: int,
    rank: int,
    trace_steps: Sequence[int],
    trace_dir: Path,
) -> PipelineTracer:
    """A tracer of this rank's ``stage``, over the pipeline's CPU ``group``; global rank 0 writes the trace file."""
    from lightning_pipe.trace import TRACE_FILE_NAME, PipelineTracer

    return PipelineTracer(
        timeline, group, stage, num_stages, rank, trace_steps, trace_dir / TRACE_FILE_NAME, writes=rank == 0
    )


def observe_step(tracer: PipelineTracer, trainer: Trainer, log_bubble_fraction: bool) -> StepObservation | None:
    """After a training step's backward: gather the stages' timelines when this step is logged (every
    ``log_every_n_steps``, as Lightning's own monitors do) or traced; log the bubble, write the trace. The step's
    observation, or None where it was not observed."""
    step = trainer.global_step
    logging = log_bubble_fraction and bool(trainer.loggers) and trainer._logger_connector.should_update_logs
    if not (logging or step in tracer.trace_steps):
        return None
    observation = tracer.observe(step)
    if observation is None:
        return None
    if logging:
        # Straight to the loggers, like LearningRateMonitor: a diagnostic, not a metric that callbacks or the
        # progress bar compare with single-device training.
        metrics = {
            "pipeline/bubble_fraction": observation.bubble_fraction,
            "pipeline/ideal_bubble_fraction": observation.ideal_bubble_fraction,
        }
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.fit_loop.epoch_loop._batches_that_stepped)
    return observation
