"""One rank's stage at run time: the user's code run up to the hand-off, each chunk run where its blocks are called,
the step's outcome shared.

Every stage runs the user's code until it calls the last block of one of this stage's chunks (the blocks before it
answer placeholders, see :mod:`lightning_pipe.execution.stage`). There the chunk runs as the caller of
:meth:`StageRuntime.run_user_code` says: on every micro-batch of a whole-batch call (:meth:`StageRuntime.forward_step`,
the engine's :meth:`~lightning_pipe.execution.engine.PipelineEngine.forward_chunk`), or on the one micro-batch of
a per-micro-batch step's forward (:mod:`lightning_pipe.execution.steps`). A stage whose call has no chunk left ends
the user's code with :class:`HandedOff`; the stage with the model's last chunk gets the chunk's output and the
user's code runs on, so the loss, metrics and ``self.log`` see what one device would.

A step's outcome (skipped or not, the loss, the logs, metric and random states) is then shared by the loss stage
with the other stages, which replay it (:mod:`lightning_pipe.execution.replayed_logs`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torchmetrics import Metric

from lightning_pipe.execution.block_calls import BlockCalls
from lightning_pipe.execution.call_order import ChunkCall
from lightning_pipe.execution.engine import PipelineEngine
from lightning_pipe.execution.learned_outputs import LearnedOutputs, OutputMessages
from lightning_pipe.execution.p2p import failed_wait
from lightning_pipe.execution.process_groups import PipelineGroups, broadcast_over_cpu_group
from lightning_pipe.execution.replayed_logs import (
    StepOutcome,
    adopt_random_states,
    load_metric_states,
    logged_metric_states,
    metric_states,
    random_states,
    recording_logs,
    replay_logs,
)
from lightning_pipe.execution.stage import StageBlocks
from lightning_pipe.execution.step_agreement import step_signature_of
from lightning_pipe.partition import microbatch
from lightning_pipe.reliability.root_cause import PipelineCommunicationError
from lightning_pipe.reliability.stall_rule import Wait

_OUTSIDE_STEP_TIMEOUT = timedelta(seconds=60)

# LightningModule hooks whose user code consumes step results, so they run where those results are: on the loss
# stage. Whatever they log is replayed on the other stages.
EPOCH_END_HOOKS = ("on_train_epoch_end", "on_validation_epoch_end", "on_test_epoch_end")


class HandedOff(BaseException):
    """Ends the user's step on the first stage once the pipelined call's micro-batches have been sent on.

    A ``BaseException`` so that a user's ``except Exception`` around the model call does not swallow it.
    """


class StageRuntime:
    """Runs the user's code on this rank's stage: ``run_step`` for a whole-batch step hook, ``run_user_code`` for a
    call whose chunks run as its caller says, ``run_on_last_stage`` for hooks that consume step results, and
    ``share_outcome`` for what the loss stage's step leaves.

    ``on_model_checkpoint`` is said once when the model's code calls its blocks under ``torch.utils.checkpoint``.
    The runtime answers the model's calls of the stage's blocks (:class:`BlockCalls`, built here): at the end of a
    chunk, :meth:`_run_chunk` runs the chunk.
    """

    def __init__(
        self,
        groups: PipelineGroups,
        engine: PipelineEngine,
        stage: StageBlocks,
        on_model_checkpoint: Callable[[], None] = lambda: None,
    ) -> None:
        self.groups = groups
        self.engine = engine
        self.stage = stage
        self._called = False  # whether the pipeline ran in the current call of the user's code
        # How the current call of the user's code runs a chunk whose blocks it called, and its whole batch's size.
        self._runs_chunk: Callable[[ChunkCall], Any] = engine.forward_chunk
        self._batch_size: int | None = None
        self._batch_sizes_checked: set[tuple[int, int | None]] = set()  # (chunk, batch size): see `_run_chunk`
        self.epoch_last_batch: int | None = None  # the training DataLoader's smaller last batch, if it has one
        self.requeues_asked = 0  # SLURM's requeue signals this rank got (a signal handler counts; the last stage's count)
        self._requeues_shared = 0  # of those, the ones the last stage's outcomes have told the pipeline about
        self.requeue_due = False  # an outcome said so: every stage requeues before its next training step
        self._outside_call = False  # a call outside a step reached the blocks; its output not yet shared
        messages = OutputMessages(groups) if groups.num_stages > 1 else None
        self.calls = BlockCalls(
            stage, self._run_chunk, self._outside_step_starts, self._share_last_output, on_model_checkpoint,
            learned=lambda calls: LearnedOutputs(stage, lambda: calls.in_step, messages),
        )

    def note_requeue_asked(self) -> None:
        """SLURM asked this rank to requeue (its signal handler says so; the loss stage's count travels on)."""
        self.requeues_asked += 1

    def take_due_requeue(self) -> bool:
        """Whether an outcome asked every stage to requeue before this training step (asked once)."""
        due, self.requeue_due = self.requeue_due, False
        return due

    def expect_epoch_last_batch(self, size: int | None) -> None:
        """The training DataLoader's smaller last batch, if it has one: the BatchNorm check covers it from step one."""
        self.epoch_last_batch = size

    def sign_step(self, module: LightningModule, hook: str, args: tuple, kwargs: dict) -> None:
        """What the stages must agree on for the step about to run (see lightning_pipe.execution.step_agreement)."""
        if self.groups.num_stages > 1:
            self.engine.sign_step(step_signature_of(module, hook, args, kwargs))

    def step_output(self, module: LightningModule, hook: str, args: tuple, kwargs: dict) -> Any:
        """The user's ``hook`` step (validation, test, predict) through the pipeline: its output on the loss stage,
        ``None`` on the others."""
        _, output = self.run_step(module, hook, args, kwargs)
        return output if self.is_loss_stage else None

    @property
    def is_loss_stage(self) -> bool:
        """Whether this is the loss stage: it holds the model's last chunk (the last stage, but stage 0 under zbv)
        and computes the model's output, the loss, the metrics, the step's results."""
        return self.engine.holds_last_chunk

    # ---- the step ------------------------------------------------------------------------------------------------

    def run_step(self, module: LightningModule, hook: str, args: tuple, kwargs: dict) -> tuple[StepOutcome, Any]:
        """Run one whole-batch step of the user's ``hook`` (``"training_step"``, ...) through the pipeline; every
        stage learns the outcome. The step's output is the user's on the last stage, ``None`` elsewhere."""
        self.sign_step(module, hook, args, kwargs)
        user_step = partial(getattr(module, hook), *args, **kwargs)
        outcome = StepOutcome()
        if self.is_loss_stage:
            with recording_logs(module) as records:
                output = self.forward_step(user_step)
            loss = loss_value(output) if hook == "training_step" else None
            outcome = StepOutcome(output is None, loss, records, logged_metric_states(module, records))
        else:
            output = self.forward_step(user_step)
        outcome = self.share_outcome(module, outcome)
        if outcome.skipped:
            self.engine.begin_step()  # no backward will come: drop the stored micro-batches
        return outcome, output

    def forward_step(self, user_step: Callable[[], Any]) -> Any:
        """Run ``user_step`` (code that calls the pipelined blocks once, with the whole batch) in this stage's role;
        its result on the last stage, ``None`` elsewhere. Nothing is shared: :meth:`run_step` adds that for
        Lightning's steps."""
        self.engine.begin_step()
        output = self.run_user_code(user_step, self.engine.forward_chunk)
        if not self._called:  # the step returned before reaching the blocks: so must the other stages' have
            self.engine.skip_step()
        return output if self.is_loss_stage else None

    def run_user_code(
        self,
        user_code: Callable[[], Any],
        runs_chunk: Callable[[ChunkCall], Any],
        chunks: Iterable[int] | None = None,
        batch_size: int | None = None,
    ) -> Any:
        """Run ``user_code`` as a step: its calls of this stage's ``chunks`` (by default every one) run by
        ``runs_chunk(call)``, checked against a batch of ``batch_size`` (by default the call's). What it returns,
        or ``None`` where it was handed off."""
        self.calls.begin_step(in_step=True, targets=chunks, frame=sys._getframe())
        self._runs_chunk, self._batch_size, self._called = runs_chunk, batch_size, False
        completed = False
        try:
            output = user_code()
            completed = True
            return output
        except HandedOff:
            completed = True
            return None
        finally:
            self.calls.end_step(completed)

    @property
    def called_the_blocks(self) -> bool:
        """Whether the last call of the user's code reached this stage's blocks."""
        return self._called

    def _run_chunk(self, chunk: int) -> Any:
        """At the last block of a chunk this call runs: run the chunk in this stage's role. The last chunk returns
        its output to the model's code; in a step, the stage's last chunk of the call ends the user's step there."""
        calls = self.calls
        grad = torch.is_grad_enabled()
        call = calls.chunk_call(chunk, detach_side_arguments=grad and (calls.in_step or self.groups.num_stages > 1))
        if not calls.in_step:
            return self._run_chunk_outside_step(call)
        self._called = True
        batch = self._batch_size or call.batch
        if grad and (chunk, batch) not in self._batch_sizes_checked:
            # Before the first training step, for its batches and the epoch's last; again for any other size.
            calls.check_micro_batches_fit_batch_norm(call, self.engine.num_micro_batches, self.epoch_last_batch, batch)
            self._batch_sizes_checked |= {(chunk, batch), (chunk, self.epoch_last_batch)}
        output = self._runs_chunk(call)
        if chunk == self.engine.last_chunk:
            return output
        if chunk == max(calls.targets):
            raise HandedOff
        return None

    def _outside_step_starts(self) -> None:
        """The model's code reached the pipelined blocks outside a step: every stage must, see below."""
        self.engine.sign_step(None)
        if self.groups.num_stages > 1:
            self._all_stages_call_the_model()
            self._outside_call = True
        self.engine.begin_step()

    def _run_chunk_outside_step(self, call: ChunkCall) -> Any:
        """A call outside a step (Lightning's ModelSummary, a callback calling ``pl_module(x)`` on every rank).

        Every stage of the pipeline must make the call: the input flows through the stages without gradients and
        every stage gets the last stage's output at the end of the blocks, so the caller's code runs on as on one
        device. With one stage the blocks simply run, in the caller's graph.
        """
        if self.groups.num_stages == 1:
            inputs = microbatch.as_tensors(call.stage_input, "the input of the pipelined module")
            return self.stage.run_micro_batch(call, 0, 1, isinstance(call.stage_input, tuple), (), *inputs)[0]
        with torch.no_grad():
            output = self.engine.forward_chunk(call)
        if call.chunk == max(self.stage.chunk_ranges):
            self.engine.end_step()
        return output

    def _all_stages_call_the_model(self) -> None:
        """Fail within a minute, naming the stage, unless every stage makes the call, rather than wait forever."""
        try:
            dist.monitored_barrier(group=self.groups.pipeline_cpu, timeout=_OUTSIDE_STEP_TIMEOUT, wait_all_ranks=True)
        except RuntimeError as error:
            raise RuntimeError(
                f"the model was called outside a training/validation/test/predict step on {self.groups.describe()},"
                f" but not on every pipeline stage within {_OUTSIDE_STEP_TIMEOUT.total_seconds():.0f} s. Outside a"
                " step the call runs through the whole pipeline, so call the model on every rank (not only under"
                f" `trainer.is_global_zero`), or call it inside a step. ({error})"
            ) from error

    def share_outside_call_output(self, output: Any) -> Any:
        """At the end of the model's call (its ``forward``): after a call outside a step that reached the blocks,
        every stage gets the last stage's output, which the head and the code after the blocks computed there (the
        other stages do not hold the head: see :mod:`lightning_pipe.execution.outside`). Any other call's output is
        left as it is."""
        if not self._outside_call:
            return output
        self._outside_call = False
        return self._share_last_output(output)

    def _share_last_output(self, output: Any) -> Any:
        """Broadcast the last stage's output of a call made outside a step to every stage of its pipeline."""
        if self.groups.num_stages == 1:
            return output
        output = apply_to_collection(output, Tensor, lambda t: t.to("cpu"))
        output = broadcast_over_cpu_group(output, self.groups.loss_rank, self.groups.pipeline_cpu)
        return apply_to_collection(output, Tensor, lambda t: t.to(self.groups.device))

    def run_on_last_stage(self, module: LightningModule, user_hook: Callable[[], None]) -> None:
        """Run a hook that consumes step results (``on_*_epoch_end``) where they are; replay what it logs."""
        outcome = StepOutcome()
        if self.is_loss_stage:
            with recording_logs(module) as records:
                user_hook()
            outcome.logs = records
            # Lightning computes the epoch value of each logged metric next, on every rank: from equal states.
            outcome.metric_states = metric_states(module)
        self.share_outcome(module, outcome)

    def run_epoch_end_hooks_on_last_stage(self, module: LightningModule) -> Callable[[], None]:
        """Run the user's epoch-end hooks (:data:`EPOCH_END_HOOKS`) on the loss stage only, replaying what they log on
        the other stages; what puts them back."""
        wrapped_hooks = []
        for hook in EPOCH_END_HOOKS:
            if hook in module.__dict__:
                continue  # already wrapped by an earlier call with this model
            user_hook = getattr(module, hook)

            def wrapped(user_hook: Callable[[], None] = user_hook) -> None:
                self.groups.watchdog.uneven_phase()  # the loss stage may take long over a whole epoch's results
                self.run_on_last_stage(module, user_hook)

            setattr(module, hook, wrapped)
            wrapped_hooks.append(hook)

        def put_back() -> None:
            for hook in wrapped_hooks:
                module.__dict__.pop(hook, None)

        return put_back

    def share_outside_call_outputs(self, module: LightningModule) -> Callable[[], None]:
        """Where the loss stage alone holds the head, a call of the model outside a step (a callback's ``pl_module(x)``)
        gets the loss stage's output on every stage at the end of the model's ``forward``; what removes the hook."""
        handle = module.register_forward_hook(lambda _, args, output: self.share_outside_call_output(output))
        return handle.remove

    def sync_metrics_within_replicas(self, module: LightningModule) -> None:
        """torchmetrics syncs over the whole world by default; only a stage's replicas hold the same metric."""
        for metric in module.modules():
            if isinstance(metric, Metric):
                metric.process_group = self.groups.replicas

    def share_outcome(self, module: LightningModule, outcome: StepOutcome) -> StepOutcome:
        """Broadcast the last stage's outcome to its pipeline; the other stages replay its logs and continue from
        its random state."""
        groups = self.groups
        if groups.num_stages == 1:
            return outcome
        if self.is_loss_stage:
            outcome.random_states = random_states(groups.device)
            asked = self.requeues_asked  # read once: a signal handled meanwhile goes with the next outcome
            outcome.requeue, self._requeues_shared = asked > self._requeues_shared, asked
        try:
            with groups.watchdog.waiting(self._outcome_wait()):
                outcome = broadcast_over_cpu_group(outcome, groups.loss_rank, groups.pipeline_cpu)
        except RuntimeError as error:
            raise self._outcome_not_shared(error) from error
        self.requeue_due |= outcome.requeue
        if not self.is_loss_stage:
            if outcome.metric_states:
                load_metric_states(module, outcome.metric_states)
            replay_logs(module, outcome.logs)
            assert outcome.random_states is not None
            adopt_random_states(outcome.random_states, groups.device)
        return outcome

    def _outcome_wait(self) -> Wait:
        """The outcome's broadcast as the stall watchdog reports it: on the last stage, or by it on the others."""
        groups = self.groups
        if self.is_loss_stage:
            return groups.watchdog.collective("the step's results (loss, logs)", groups.pipeline_cpu, sending=True)
        return Wait("the step's results (loss, logs)", (groups.loss_rank,))

    def _outcome_not_shared(self, error: RuntimeError) -> PipelineCommunicationError:
        """The error when the last stage's results could not be shared: which stage waited for which."""
        groups, timeout = self.groups, self.groups.timeout
        if self.is_loss_stage:
            waited = "sending the step's results (loss, logs) to the other stages"
            return failed_wait(groups.describe(), waited, "another stage of its pipeline", timeout, error)
        last = groups.describe(groups.layout.loss_stage)
        waited = "waiting for the last stage's step results (loss, logs)"
        return failed_wait(groups.describe(), waited, last, timeout, error)

def loss_tensor(output: Any) -> Tensor | None:
    """The loss in a training step's output: the output itself, or its ``"loss"`` entry."""
    loss = output.get("loss") if isinstance(output, Mapping) else output
    return loss if isinstance(loss, Tensor) else None


def loss_value(output: Any) -> float | None:
    loss = loss_tensor(output)
    return float(loss.detach()) if loss is not None else None
