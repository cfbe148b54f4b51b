"""A training step on this rank, in the one mode its schedule chose at set-up: whole-batch or per-micro-batch.

* :class:`WholeBatchStep` (GPipe): the user's ``training_step`` runs once on the whole batch; each chunk whose blocks
  it calls runs on every micro-batch (:meth:`~lightning_pipe.execution.engine.PipelineEngine.forward_chunk`), and
  Lightning's ``backward`` runs the blocks' backward afterwards, micro-batch by micro-batch
  (:meth:`~lightning_pipe.execution.engine.PipelineEngine.backward_phase`).
* :class:`MicroBatchStep` (1F1B, interleaved, zero bubble): the engine executes the whole schedule inside
  ``training_step``; each forward it hands back is answered by running the user's ``training_step`` on that
  micro-batch (the batch split along dim 0, the same ``batch_idx``), up to the chunk, and on through this stage's
  later chunks, whose calls it records for their own forwards; on the model's last chunk it runs to its end, and its
  loss, weighted by the micro-batch's share of what the batch's loss averages over
  (:mod:`lightning_pipe.execution.loss_items`), is back-propagated when the schedule says. Lightning's ``backward``
  then only adds the gradients the step left.

Either way the loss stage's outcome is shared with every stage (:meth:`StageRuntime.share_outcome`).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor, nn

from lightning_pipe.execution.call_order import ChainValue, ChunkCall
from lightning_pipe.execution.engine import ChunkForward
from lightning_pipe.execution.gradients import add_gradients, swap_gradients
from lightning_pipe.execution.loss_items import LossItems, announce, unequal_label_shares, warn_weighted_by_samples
from lightning_pipe.execution.replayed_logs import (
    LogRecord,
    StepOutcome,
    logged_metric_states,
    merged_logs,
    merged_output,
    recording_logs,
    replay_logs,
)
from lightning_pipe.execution.runtime import StageRuntime, loss_tensor, loss_value
from lightning_pipe.partition import microbatch


class WholeBatchStep:
    """A training step whose loss is computed on the whole batch: one call of the user's ``training_step``."""

    def __init__(self, runtime: StageRuntime) -> None:
        self.runtime = runtime
        self.skipped = False  # the last training step returned None: no backward, no optimizer step

    def training_step(self, module: LightningModule, model: nn.Module, precision: Any, args: tuple, kwargs: dict) -> Any:
        """What Lightning's training step gets on this rank (see :func:`_lightning_output`)."""
        with precision.train_step_context():
            outcome, output = self.runtime.run_step(module, "training_step", args, kwargs)
        self.skipped = outcome.skipped
        return _lightning_output(self.runtime, outcome, output)

    def backward(self, closure_loss: Tensor, module: LightningModule, precision: Any, *args: Any, **kwargs: Any) -> None:
        """The step's backward on this stage, between the precision's ``pre_backward`` and ``post_backward``: on the
        loss stage the user's ``loss.backward()`` through the model's head to the blocks' output, then the blocks' own
        backward, micro-batch by micro-batch."""
        if self.runtime.is_loss_stage:
            precision.backward(closure_loss, module, *args, **kwargs)
        self.runtime.engine.backward_phase()


class MicroBatchStep:
    """A training step of a per-micro-batch schedule: the user's ``training_step`` once per micro-batch, every
    backward inside it where the schedule puts it."""

    def __init__(self, runtime: StageRuntime) -> None:
        self.runtime = runtime
        self.skipped = False  # the last training step returned None: no backward, no optimizer step
        self._loss_items: LossItems | None = None  # what a micro-batch's loss averages over, decided once
        # The step's gradients, from `training_step` to Lightning's `backward` (see `swap_gradients`).
        self._gradients: list[tuple[list[nn.Parameter], list[Tensor | None]]] = []
        # The calls of this stage's later chunks, (chunk, micro-batch) -> call, recorded by the user's step on the
        # micro-batch's first chunk here and run at their own forwards.
        self._calls_ahead: dict[tuple[int, int], ChunkCall] = {}
        # This step's calls of chunks that take nothing from the user's step but the previous chunk's output, by
        # chunk: the step on a later micro-batch would make the same call (see `_same_for_every_micro_batch`).
        self._repeated: dict[int, ChunkCall] | None = None
        stage, last = runtime.stage, runtime.engine.last_chunk
        # The chunks of this stage after each of its chunks whose calls the user's step records while it runs that
        # chunk (every one but the model's last, whose call must return the micro-batch's output to the step).
        self._later = {k: [j for j in sorted(stage.chunk_ranges) if k < j < last] for k in stage.chunk_ranges}

    def training_step(self, module: LightningModule, model: nn.Module, precision: Any, args: tuple, kwargs: dict) -> Any:
        """Every action of the step's schedule; what Lightning's training step gets (see :func:`_lightning_output`).
        The precision's context is entered around each call of the user's step, not around the backwards between."""
        trainable = [p for p in model.parameters() if p.requires_grad]
        earlier = swap_gradients(trainable, [None] * len(trainable))  # Lightning may zero them before `backward`
        outcome, output = self.run(module, precision, args, kwargs)
        self._gradients = [(trainable, swap_gradients(trainable, earlier))]
        self.skipped = outcome.skipped
        if outcome.skipped:
            self.runtime.engine.begin_step()
        return _lightning_output(self.runtime, outcome, output)

    def backward(self, closure_loss: Tensor, module: LightningModule, precision: Any, *args: Any, **kwargs: Any) -> None:
        """Every backward ran in the step, where its schedule said: its gradients join those accumulated before."""
        for parameters, gradients in self._gradients:
            add_gradients(parameters, gradients)
        self._gradients = []

    def run(self, module: LightningModule, precision: Any, args: tuple, kwargs: dict) -> tuple[StepOutcome, Any]:
        """Execute the schedule, each forward answered by the user's step on its micro-batch (its gradients accumulate
        where they are); the loss stage merges what the steps logged and returned into one step's worth, which every
        stage then replays."""
        runtime, engine = self.runtime, self.runtime.engine
        runtime.sign_step(module, "training_step", args, kwargs)
        batch, rest = args[0], args[1:]
        parts = microbatch.split_batch(batch, engine.num_micro_batches)
        sizes = [microbatch.batch_size_of(part) for part in parts]
        items = self._items_per_micro_batch(module, parts, sizes)
        weights = [item / sum(items) for item in items]  # each micro-batch's share of what the loss averages over
        results: dict[int, Any] = {}
        records: dict[int, list[LogRecord]] = {}
        self._calls_ahead = {}
        # The user's step runs once per micro-batch on a stage whose chunks' calls depend on the micro-batch; a chunk
        # between the first and the loss stage's that it calls with the previous chunk's output alone runs its
        # first recorded call on every micro-batch of the same shapes (unless a block's output shapes come in
        # messages from its stage, which each run of the step receives: see learned_outputs).
        learned = runtime.calls.placeholders.learned
        same_shapes = len(set(sizes)) == 1 and (learned is None or not learned.not_on_meta)
        self._repeated = {} if same_shapes else None
        engine.begin_step()
        for forward in engine.execute(engine.plan(len(parts))):
            k, m = forward.chunk, forward.micro_batch
            with precision.train_step_context():
                ahead = self._calls_ahead.pop((k, m), None)
                if ahead is None and self._repeated is not None:
                    ahead = self._repeated.get(k)
                if ahead is not None:  # recorded by this micro-batch's step on an earlier chunk of this stage
                    forward.run(ahead)
                    continue
                user_step = partial(module.training_step, parts[m], *rest, **kwargs)
                runs_chunk = partial(self._run_chunk, forward)
                if k != engine.last_chunk:
                    runtime.run_user_code(user_step, runs_chunk, [k, *self._later[k]], sum(sizes))
                    continue
                with recording_logs(module, log=False) as records[m]:
                    results[m] = runtime.run_user_code(user_step, runs_chunk, [k], sum(sizes))
            loss = loss_tensor(results[m]) if forward.ran and items[m] > 0 else None  # a mean over no items: none
            if loss is not None:
                forward.loss = _scaled(module, precision, loss * weights[m])
        engine.end_step()
        outcome, output = StepOutcome(), None
        if runtime.is_loss_stage:
            ran = {m: weights[m] for m in results}
            logs = merged_logs(records, ran)
            replay_logs(module, logs)  # what the steps logged, once for the whole step
            output = merged_output(results, ran)
            outcome = StepOutcome(output is None, loss_value(output), logs, logged_metric_states(module, logs))
        return runtime.share_outcome(module, outcome), output

    def _run_chunk(self, forward: ChunkForward, call: ChunkCall) -> Any:
        """The user's step on ``forward``'s micro-batch called ``call``'s chunk: run it if it is ``forward``'s, else
        keep the call for the chunk's own forward (so that the user's step runs once per micro-batch on this stage,
        not once per chunk)."""
        if self._repeated is not None and 0 < call.chunk < self.runtime.engine.last_chunk:
            if _same_for_every_micro_batch(call):
                self._repeated[call.chunk] = call
        if call.chunk != forward.chunk:
            self._calls_ahead[(call.chunk, forward.micro_batch)] = call
            return None
        return forward.run(call, call.stage_input if call.chunk == 0 else None)

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


def _same_for_every_micro_batch(call: ChunkCall) -> bool:
    """Whether the user's step on any micro-batch of the same shapes would call ``call``'s chunk alike: each block
    takes the previous one's output (or an earlier block's, which travels with it) and nothing else but flags
    (``None``, ``True``, ``False``), so the chunk's forward needs nothing from that run of the user's step."""
    return not call.leaves and all(
        not block.restart and all(
            value is None or isinstance(value, (bool, ChainValue)) for value in (*block.args[1:], *block.kwargs.values())
        )
        for block in call.calls
    )


TrainingStep = WholeBatchStep | MicroBatchStep


def training_step_for(runtime: StageRuntime) -> TrainingStep:
    """The training step of ``runtime``'s schedule: whole-batch or per-micro-batch, chosen once."""
    return MicroBatchStep(runtime) if runtime.engine.schedule.per_micro_batch else WholeBatchStep(runtime)


def _lightning_output(runtime: StageRuntime, outcome: StepOutcome, output: Any) -> Any:
    """What Lightning's training step gets on this rank: the user's output on the loss stage, a stand-in loss
    elsewhere (Lightning calls backward on it; the pipeline's own backward runs instead)."""
    if outcome.skipped:
        # Lightning refuses `None` from a distributed training_step. A placeholder loss that `backward` ignores,
        # and that the optimizer-step closure reports as None, gives one device's behaviour: no update.
        return torch.zeros((), device=runtime.groups.device)
    return output if runtime.is_loss_stage else torch.tensor(outcome.loss, device=runtime.groups.device)


def _scaled(module: LightningModule, precision: Any, loss: Tensor) -> Tensor:
    """What a per-micro-batch step back-propagates of a micro-batch's (weighted) loss: divided over Lightning's
    gradient accumulation, and scaled by the gradient scaler, as Lightning does with one step's loss."""
    trainer = module._trainer  # none where the runtime runs without Lightning's loop (the benchmarks)
    loss = loss / (trainer.accumulate_grad_batches if trainer is not None else 1)
    scaler = getattr(precision, "scaler", None)
    return scaler.scale(loss) if scaler is not None else loss
