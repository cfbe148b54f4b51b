"""One rank's stage at run time: the role it plays in a step, the user's step up to the hand-off, and backward.

Every stage runs the user's step until the model's code calls this stage's last block (the blocks before it
answer placeholders, see :mod:`lightning_pipe.stage`). There, in one step (``S`` stages):

* the first stage splits the blocks' input into micro-batches, runs them through its blocks and sends them on;
* a middle stage receives, runs and sends every micro-batch;
* both then end the user's step with :class:`HandedOff`;
* the last stage receives and runs every micro-batch: the call returns the joined output of all micro-batches and
  the user's step runs on, so the loss, metrics and ``self.log`` see the whole mini-batch. Its outcome (skipped or
  not, the loss, the logs, metric and random states) is then shared with the other stages, which replay it
  (:mod:`lightning_pipe.outcome`).

Backward: the last stage's ``loss.backward()`` reaches each micro-batch; the other stages run the backward phase
with the gradients that arrive from the next stage (:meth:`PipelineEngine.backward`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_pipe.engine import PipelineEngine
from lightning_pipe.groups import PipelineGroups
from lightning_pipe.outcome import (
    StepOutcome,
    adopt_random_states,
    load_metric_states,
    logged_metric_states,
    metric_states,
    random_states,
    recording_logs,
    replay_logs,
)
from lightning_pipe.p2p import PipelineCommunicationError, failed_wait
from lightning_pipe.stage import StageBlocks
from lightning_pipe.stall_rule import Wait

_OUTSIDE_STEP_TIMEOUT = timedelta(seconds=60)


class HandedOff(BaseException):
    """Ends the user's step on the first stage once the pipelined call's micro-batches have been sent on.

    A ``BaseException`` so that a user's ``except Exception`` around the model call does not swallow it.
    """


class StageRuntime:
    """Runs steps on this rank's stage: ``run_step`` for the user's step hooks, ``backward_from_next_stage`` and
    ``end_backward`` around Lightning's backward, ``run_on_last_stage`` for hooks that consume step results."""

    def __init__(self, groups: PipelineGroups, engine: PipelineEngine, stage: StageBlocks) -> None:
        self.groups = groups
        self.engine = engine
        self.stage = stage
        self.step_skipped = False  # the last training step returned None: no backward, no optimizer step
        self._called = False  # whether the pipeline ran in the current step
        self._batch_sizes_checked: set[int | None] = set()  # for BatchNorm, see `_run_pipeline`
        self.epoch_last_batch: int | None = None  # the training DataLoader's smaller last batch, if it has one
        stage.on_last_local_call = self._run_pipeline
        stage.on_outside_step_start = self._outside_step_starts
        stage.outside_step_output = self._share_last_output

    @property
    def is_first(self) -> bool:
        return self.groups.is_first

    @property
    def is_last(self) -> bool:
        return self.groups.is_last

    # ---- the step ------------------------------------------------------------------------------------------------

    def run_step(self, module: LightningModule, hook: str, args: tuple, kwargs: dict) -> tuple[StepOutcome, Any]:
        """Run one step of the user's ``hook`` (``"training_step"``, ...) through the pipeline; every stage learns
        the outcome. The step's output is the user's on the last stage, ``None`` elsewhere."""
        user_step = partial(getattr(module, hook), *args, **kwargs)
        outcome = StepOutcome()
        if self.is_last:
            with recording_logs(module) as records:
                output = self.forward_step(user_step)
            loss = _loss_value(output) if hook == "training_step" else None
            outcome = StepOutcome(output is None, loss, records, logged_metric_states(module, records))
        else:
            output = self.forward_step(user_step)
        outcome = self.share_outcome(module, outcome)
        if hook == "training_step":
            self.step_skipped = outcome.skipped
        if outcome.skipped:
            self.engine.begin_step()  # no backward will come: drop the stored micro-batches
        return outcome, output

    def forward_step(self, user_step: Callable[[], Any]) -> Any:
        """Run ``user_step`` (code that calls the pipelined blocks once) in this stage's role; its result on the
        last stage, ``None`` elsewhere. Nothing is shared: :meth:`run_step` adds that for Lightning's steps."""
        with self._user_step():
            try:
                output = user_step()
            except HandedOff:
                return None
            if self.is_last:
                if not self._called and not self.is_first:
                    self.engine.drain()
                return output
            # The step returned before reaching this stage's blocks: so must the first stage's have.
            if self.is_first:
                self.engine.send_skip()
            else:
                self.engine.pass_skip()
            return None

    @contextlib.contextmanager
    def _user_step(self) -> Iterator[None]:
        """Marks the user's step: the pipelined blocks' calls inside it are one micro-batched pipeline step."""
        self.engine.begin_step()
        self.stage.begin_step(in_step=True)
        self._called = False
        try:
            yield
        finally:
            self.stage.in_step = False

    def _run_pipeline(self) -> Any:
        """At this stage's last block: run the forward phase in this stage's role. In a step, a stage other than the
        last ends the user's step here; the last stage returns the joined output."""
        engine, stage = self.engine, self.stage
        if not stage.in_step:
            return self._run_pipeline_outside_step()
        self._called = True
        if torch.is_grad_enabled() and stage.batch_size() not in self._batch_sizes_checked:
            # Before the first training step, for its batches and the epoch's last; again for any other batch size.
            stage.check_micro_batches_fit_batch_norm(engine.num_micro_batches, self.epoch_last_batch)
            self._batch_sizes_checked |= {stage.batch_size(), self.epoch_last_batch}
        if self.is_first and self.is_last:
            return engine.forward_local(stage.stage_input())
        if self.is_last:
            return engine.forward_last()
        if torch.is_grad_enabled():
            stage.detach_side_arguments()  # each micro-batch's backward stops at them; see the engine's backward
        if self.is_first:
            engine.forward_first(stage.stage_input())
        else:
            engine.relay()
        raise HandedOff

    def _outside_step_starts(self) -> None:
        """The model's code reached the pipelined blocks outside a step: every stage must, see below."""
        if self.groups.num_stages > 1:
            self._all_stages_call_the_model()
        self.engine.begin_step()

    def _run_pipeline_outside_step(self) -> Any:
        """A call outside a step (Lightning's ModelSummary, a callback calling ``pl_module(x)`` on every rank).

        Every stage of the pipeline must make the call: the input flows through the stages without gradients and
        every stage gets the last stage's output at the end of the blocks, so the caller's code runs on as on one
        device.
        """
        engine, stage, output = self.engine, self.stage, None
        if self.is_first and self.is_last:
            return engine.forward_local(stage.stage_input())
        with torch.no_grad():
            if self.is_first:
                engine.forward_first(stage.stage_input())
            elif self.is_last:
                output = engine.forward_last()
            else:
                engine.relay()
            engine.end_step()
        return output

    def _all_stages_call_the_model(self) -> None:
        """Fail within a minute, naming the stage, unless every stage makes the call, rather than wait forever."""
        try:
            dist.monitored_barrier(group=self.groups.meta, timeout=_OUTSIDE_STEP_TIMEOUT, wait_all_ranks=True)
        except RuntimeError as error:
            raise RuntimeError(
                f"the model was called outside a training/validation/test/predict step on {self.groups.describe()},"
                f" but not on every pipeline stage within {_OUTSIDE_STEP_TIMEOUT.total_seconds():.0f} s. Outside a"
                " step the call runs through the whole pipeline, so call the model on every rank (not only under"
                f" `trainer.is_global_zero`), or call it inside a step. ({error})"
            ) from error

    def _share_last_output(self, output: Any) -> Any:
        """Broadcast the last stage's output of a call made outside a step to every stage of its pipeline."""
        if self.groups.num_stages == 1:
            return output
        holder = [apply_to_collection(output, Tensor, lambda t: t.to("cpu"))]
        dist.broadcast_object_list(holder, src=self.groups.last_stage_rank, group=self.groups.meta)
        return apply_to_collection(holder[0], Tensor, lambda t: t.to(self.groups.device))

    def run_on_last_stage(self, module: LightningModule, user_hook: Callable[[], None]) -> None:
        """Run a hook that consumes step results (``on_*_epoch_end``) where they are; replay what it logs."""
        outcome = StepOutcome()
        if self.is_last:
            with recording_logs(module) as records:
                user_hook()
            outcome.logs = records
            # Lightning computes the epoch value of each logged metric next, on every rank: from equal states.
            outcome.metric_states = metric_states(module)
        self.share_outcome(module, outcome)

    def share_outcome(self, module: LightningModule, outcome: StepOutcome) -> StepOutcome:
        """Broadcast the last stage's outcome to its pipeline; the other stages replay its logs and continue from
        its random state."""
        groups = self.groups
        if groups.num_stages == 1:
            return outcome
        if self.is_last:
            outcome.random_states = random_states(groups.device)
        holder = [outcome]
        try:
            with groups.watchdog.waiting(self._outcome_wait()):
                dist.broadcast_object_list(holder, src=groups.last_stage_rank, group=groups.meta)
        except RuntimeError as error:
            raise self._outcome_not_shared(error) from error
        outcome = holder[0]
        if not self.is_last:
            if outcome.metric_states:
                load_metric_states(module, outcome.metric_states)
            replay_logs(module, outcome.logs)
            assert outcome.random_states is not None
            adopt_random_states(outcome.random_states, groups.device)
        return outcome

    def _outcome_wait(self) -> Wait:
        """The outcome's broadcast as the stall watchdog reports it: on the last stage, or by it on the others."""
        groups = self.groups
        if self.is_last:
            return groups.watchdog.collective("the step's results (loss, logs)", groups.meta, sending=True)
        return Wait("the step's results (loss, logs)", (groups.last_stage_rank,))

    def _outcome_not_shared(self, error: RuntimeError) -> PipelineCommunicationError:
        """The error when the last stage's results could not be shared: which stage waited for which."""
        groups, timeout = self.groups, self.groups.timeout
        if self.is_last:
            waited = "sending the step's results (loss, logs) to the other stages"
            return failed_wait(groups.describe(), waited, "another stage of its pipeline", timeout, error)
        last = groups.describe(groups.num_stages - 1)
        waited = "waiting for the last stage's step results (loss, logs)"
        return failed_wait(groups.describe(), waited, last, timeout, error)

    # ---- backward ------------------------------------------------------------------------------------------------

    @property
    def holds_loss(self) -> bool:
        """Whether backward starts here from the loss (the last stage) rather than from gradients that arrive."""
        return self.is_last

    def backward_from_next_stage(self) -> None:
        """First and middle stages: back-propagate with the gradients the next stage sends."""
        self.engine.backward()

    def end_backward(self) -> None:
        """Last stage, after the loss's backward: send the gradients autograd did not reach."""
        if self.is_last and not self.is_first:
            self.engine.finish_last_backward()


def _loss_value(output: Any) -> float | None:
    loss = output.get("loss") if isinstance(output, Mapping) else output
    return float(loss.detach()) if isinstance(loss, Tensor) else None
