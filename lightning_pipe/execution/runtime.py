"""One rank's stage at run time: the role it plays in a step, the user's step up to the hand-off, and backward.

Every stage runs the user's step until the model's code calls the last block of one of this stage's chunks (the
blocks before it answer placeholders, see :mod:`lightning_pipe.execution.stage`). There the chunk runs:

* **whole-batch steps** (GPipe, and every forward-only step): the chunk runs on every micro-batch of the batch,
  receiving its inputs from the stage of the chunk before and sending its outputs on. A stage whose step has no
  chunk left ends the user's step with :class:`HandedOff`; the stage with the model's last chunk gets the joined
  output of all micro-batches and the user's step runs on, so the loss, metrics and ``self.log`` see the whole
  mini-batch. Lightning's ``backward`` then runs the blocks' backward, micro-batch by micro-batch
  (:meth:`PipelineEngine.backward_phase`);
* **per-micro-batch steps** (1F1B, interleaved, zero bubble): the user's ``training_step`` runs on a micro-batch at
  the schedule's forward of its first chunk on this stage, up to that chunk, and on through this stage's later
  chunks, whose calls it records for their own forwards (see :meth:`StageRuntime._later_chunks`); it runs again
  for the model's last chunk, where it runs to its end and its loss, weighted by the micro-batch's share of the
  batch's samples (or of the items its loss averages over: the LightningModule's ``items_in_loss(batch)``, a
  Hugging Face model's label tokens, see :mod:`lightning_pipe.execution.loss_items`), is back-propagated when the
  schedule says (:meth:`PipelineEngine.run_schedule`).

Either way the step's outcome (skipped or not, the loss, the logs, metric and random states) is then shared by the
last stage with the other stages, which replay it (:mod:`lightning_pipe.execution.replayed_logs`).
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

from lightning_pipe.execution.block_calls import BlockCalls
from lightning_pipe.execution.call_order import ChunkCall
from lightning_pipe.execution.engine import PipelineEngine
from lightning_pipe.execution.learned_outputs import LearnedOutputs, OutputMessages
from lightning_pipe.execution.loss_items import LossItems, announce, unequal_label_shares, warn_weighted_by_samples
from lightning_pipe.execution.p2p import failed_wait
from lightning_pipe.execution.process_groups import PipelineGroups, broadcast_over_cpu_group
from lightning_pipe.execution.replayed_logs import (
    LogRecord,
    StepOutcome,
    merged_logs,
    merged_output,
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


class HandedOff(BaseException):
    """Ends the user's step on the first stage once the pipelined call's micro-batches have been sent on.

    A ``BaseException`` so that a user's ``except Exception`` around the model call does not swallow it.
    """


class StageRuntime:
    """Runs steps on this rank's stage: ``run_step`` for the user's step hooks, ``backward`` in Lightning's backward
    of a whole-batch step, ``run_on_last_stage`` for hooks that consume step results.

    ``scale_loss`` turns a micro-batch's loss into what its backward starts from in a per-micro-batch step (its
    share of the batch, Lightning's gradient accumulation, a gradient scaler); ``step_context`` is the precision's
    context for the user's step (autocast), entered around each call of it there, and not around backward.
    ``on_model_checkpoint`` is said once when the model's code calls its blocks under ``torch.utils.checkpoint``.

    The runtime answers the model's calls of the stage's blocks (:class:`BlockCalls`, built here): at the end of a
    chunk, :meth:`_run_chunk` hands the chunk to the engine, which runs the stage's blocks on each micro-batch.
    """

    def __init__(
        self,
        groups: PipelineGroups,
        engine: PipelineEngine,
        stage: StageBlocks,
        scale_loss: Callable[[Tensor], Tensor] = lambda loss: loss,
        step_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        on_model_checkpoint: Callable[[], None] = lambda: None,
    ) -> None:
        self.groups = groups
        self.engine = engine
        self.stage = stage
        self.scale_loss = scale_loss
        self.step_context = step_context
        self.step_skipped = False  # the last training step returned None: no backward, no optimizer step
        self._called = False  # whether the pipeline ran in the current step
        self._micro_batch: int | None = None  # in a per-micro-batch step: the micro-batch the user's step runs on
        self._batch_sizes_checked: set[tuple[int, int | None]] = set()  # (chunk, batch size): see `_run_chunk`
        self._batch_size = 0  # in a per-micro-batch step: the whole batch's
        self._loss_items: LossItems | None = None  # what a per-micro-batch step's loss averages over, decided once
        # In a per-micro-batch step: the calls of this stage's later chunks, (chunk, micro-batch) -> call, recorded by
        # the user's step on the micro-batch's first chunk here and run at their own forwards.
        self._calls_ahead: dict[tuple[int, int], ChunkCall] = {}
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

    @property
    def is_last(self) -> bool:
        """Whether this stage computes the model's output: the loss, the metrics, the step's results."""
        return self.engine.holds_last_chunk

    @property
    def per_micro_batch(self) -> bool:
        """Whether training steps call the user's ``training_step`` once per micro-batch (every schedule but GPipe)."""
        return self.engine.schedule.per_micro_batch

    # ---- the step ------------------------------------------------------------------------------------------------

    def run_step(self, module: LightningModule, hook: str, args: tuple, kwargs: dict) -> tuple[StepOutcome, Any]:
        """Run one step of the user's ``hook`` (``"training_step"``, ...) through the pipeline; every stage learns
        the outcome. The step's output is the user's on the last stage, ``None`` elsewhere."""
        if self.groups.num_stages > 1:  # what the stages must agree on: see lightning_pipe.execution.step_agreement
            self.engine.step_signature = step_signature_of(module, hook, args, kwargs)
        if hook == "training_step" and self.per_micro_batch:
            outcome, output = self._run_per_micro_batch(module, args, kwargs)
        else:
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
        """Run ``user_step`` (code that calls the pipelined blocks once, with the whole batch) in this stage's role;
        its result on the last stage, ``None`` elsewhere. Nothing is shared: :meth:`run_step` adds that for
        Lightning's steps."""
        with self._user_step():
            try:
                output = user_step()
            except HandedOff:
                return None
            if not self._called:  # the step returned before reaching the blocks: so must the other stages' have
                self.engine.skip_step()
            return output if self.is_last else None

    @contextlib.contextmanager
    def _user_step(self) -> Iterator[None]:
        """Marks the user's step: the pipelined blocks' calls inside it are one micro-batched pipeline step."""
        self.engine.begin_step()
        self.calls.begin_step(in_step=True)
        self._called = False
        try:
            yield
        finally:
            self.calls.end_step()

    def _run_per_micro_batch(self, module: LightningModule, args: tuple, kwargs: dict) -> tuple[StepOutcome, Any]:
        """A training step of a per-micro-batch schedule: the user's ``training_step`` runs once per micro-batch (the
        batch split along dim 0, the same ``batch_idx``), whenever the schedule runs a forward; each loss, weighted
        by its micro-batch's share of the batch, is back-propagated when the schedule says. The last stage merges
        what the steps logged and returned into one step's worth, which every stage then replays."""
        batch, rest = args[0], args[1:]
        parts = microbatch.split_batch(batch, self.engine.num_micro_batches)
        sizes = [microbatch.batch_size_of(part) for part in parts]
        self._batch_size = sum(sizes)
        items = self._items_per_micro_batch(module, parts, sizes)
        weights = [item / sum(items) for item in items]  # each micro-batch's share of what the loss averages over
        results: dict[int, Any] = {}
        records: dict[int, list[LogRecord]] = {}
        self._calls_ahead = {}

        def run_user_step(chunk: int, m: int) -> None:
            ahead = self._calls_ahead.pop((chunk, m), None)
            if ahead is not None:  # recorded by this micro-batch's step on an earlier chunk of this stage
                with self.step_context():
                    self.engine.forward_micro_batch(ahead, m)
                return
            self.calls.begin_step(in_step=True, targets=[chunk, *self._later_chunks(chunk)])
            self._micro_batch, self._called = m, False
            try:
                with self.step_context():
                    if chunk != self.engine.last_chunk:
                        module.training_step(parts[m], *rest, **kwargs)
                        return
                    with recording_logs(module, log=False) as records[m]:
                        results[m] = module.training_step(parts[m], *rest, **kwargs)
            except HandedOff:
                return
            finally:
                self._micro_batch = None
                self.calls.end_step()
            if self._called:
                loss = _loss_tensor(results[m]) if items[m] > 0 else None  # a mean over no items: no gradient
                self.engine.set_loss(m, None if loss is None else self.scale_loss(loss * weights[m]))

        self.engine.begin_step()
        self.engine.run_schedule(len(parts), run_user_step)
        outcome, output = StepOutcome(), None
        if self.is_last:
            ran = {m: weights[m] for m in results}
            logs = merged_logs(records, ran)
            replay_logs(module, logs)  # what the steps logged, once for the whole step
            output = merged_output(results, ran)
            outcome = StepOutcome(output is None, _loss_value(output), logs, logged_metric_states(module, logs))
        return self.share_outcome(module, outcome), output

    def _later_chunks(self, chunk: int) -> list[int]:
        """The chunks of this stage after ``chunk`` whose calls the user's step on a micro-batch records while it runs
        ``chunk`` (every one but the model's last, whose call must return the micro-batch's output to the step)."""
        return [k for k in sorted(self.stage.chunk_ranges) if chunk < k < self.engine.last_chunk]

    def _items_per_micro_batch(self, module: LightningModule, parts: list[Any], sizes: list[int]) -> list[float]:
        """What each micro-batch's loss averages over (:mod:`lightning_pipe.execution.loss_items`), known before the
        first micro-batch runs, so that the first backward already has its weight. Said once at the first step;
        weighting by samples where the labels say it is wrong for a token mean is warned of, once."""
        if self._loss_items is None:
            self._loss_items = LossItems.of(module, parts[0])
            announce(self._loss_items, module)
            shares = unequal_label_shares(parts, sizes) if self._loss_items.count is None else None
            if shares is not None:
                warn_weighted_by_samples(module, shares)
        return self._loss_items.per_micro_batch(parts, sizes)

    def _run_chunk(self, chunk: int) -> Any:
        """At the last block of a chunk this call runs: run the chunk in this stage's role. The last chunk returns
        its output to the model's code; in a step, the stage's last chunk of the call ends the user's step there."""
        engine, calls = self.engine, self.calls
        grad = torch.is_grad_enabled()
        call = calls.chunk_call(chunk, detach_side_arguments=grad and (calls.in_step or self.groups.num_stages > 1))
        if not calls.in_step:
            return self._run_chunk_outside_step(call)
        self._called = True
        batch = self._batch_size if self._micro_batch is not None else call.batch
        if grad and (chunk, batch) not in self._batch_sizes_checked:
            # Before the first training step, for its batches and the epoch's last; again for any other size.
            calls.check_micro_batches_fit_batch_norm(call, engine.num_micro_batches, self.epoch_last_batch, batch)
            self._batch_sizes_checked |= {(chunk, batch), (chunk, self.epoch_last_batch)}
        if self._micro_batch is not None and chunk != min(calls.targets):
            # A later chunk of this stage in a per-micro-batch step: its call is kept for its own forward, so that the
            # user's step runs once per micro-batch on this stage, not once per chunk (see `_later_chunks`).
            self._calls_ahead[(chunk, self._micro_batch)] = call
            output = None
        elif self._micro_batch is not None:
            output = engine.forward_micro_batch(call, self._micro_batch)
        else:
            output = engine.forward_chunk(call)
        if chunk == engine.last_chunk:
            return output
        if chunk == max(calls.targets):
            raise HandedOff
        return None

    def _outside_step_starts(self) -> None:
        """The model's code reached the pipelined blocks outside a step: every stage must, see below."""
        self.engine.step_signature = None
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
            dist.monitored_barrier(group=self.groups.meta, timeout=_OUTSIDE_STEP_TIMEOUT, wait_all_ranks=True)
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
        output = broadcast_over_cpu_group(output, self.groups.loss_rank, self.groups.meta)
        return apply_to_collection(output, Tensor, lambda t: t.to(self.groups.device))

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
            asked = self.requeues_asked  # read once: a signal handled meanwhile goes with the next outcome
            outcome.requeue, self._requeues_shared = asked > self._requeues_shared, asked
        try:
            with groups.watchdog.waiting(self._outcome_wait()):
                outcome = broadcast_over_cpu_group(outcome, groups.loss_rank, groups.meta)
        except RuntimeError as error:
            raise self._outcome_not_shared(error) from error
        self.requeue_due |= outcome.requeue
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
        return Wait("the step's results (loss, logs)", (groups.loss_rank,))

    def _outcome_not_shared(self, error: RuntimeError) -> PipelineCommunicationError:
        """The error when the last stage's results could not be shared: which stage waited for which."""
        groups, timeout = self.groups, self.groups.timeout
        if self.is_last:
            waited = "sending the step's results (loss, logs) to the other stages"
            return failed_wait(groups.describe(), waited, "another stage of its pipeline", timeout, error)
        last = groups.describe(groups.layout.loss_stage)
        waited = "waiting for the last stage's step results (loss, logs)"
        return failed_wait(groups.describe(), waited, last, timeout, error)

    # ---- backward ------------------------------------------------------------------------------------------------

    def backward(self) -> None:
        """A whole-batch step's backward of the blocks, as the schedule says: on the last stage from the gradients the
        user's ``loss.backward()`` left on the leaves of the blocks' output, elsewhere from those the next stage
        sends."""
        self.engine.backward_phase()


def _loss_tensor(output: Any) -> Tensor | None:
    loss = output.get("loss") if isinstance(output, Mapping) else output
    return loss if isinstance(loss, Tensor) else None


def _loss_value(output: Any) -> float | None:
    loss = _loss_tensor(output)
    return float(loss.detach()) if loss is not None else None
