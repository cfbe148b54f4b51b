"""Runs this process's share of a GPipe step: micro-batch forwards and backwards with their sends and receives.

Roles (``S`` stages, ``M`` micro-batches):

* first stage: the user's step calls the pipelined module; its input is split into micro-batches, each runs
  through the local layers and is sent on. Then :class:`HandedOff` ends the user's step here.
* middle stages: :meth:`PipelineEngine.relay` receives, computes and sends ``M`` times; no user code runs.
* last stage: the user's step calls the pipelined module; the call receives the ``M`` micro-batches, runs them and
  returns their concatenation, so the user's loss sees the whole mini-batch. ``loss.backward()`` then reaches each
  micro-batch's received activations, whose gradient hooks send the gradients upstream as soon as they exist.
* backward on the other stages (:meth:`PipelineEngine.backward`): receive gradients in reverse micro-batch order,
  back-propagate through the stored outputs, send the input gradients on upstream.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

from lightning_pipe import microbatch
from lightning_pipe.batchnorm import DeferredBatchNorm
from lightning_pipe.config import CheckpointMode
from lightning_pipe.microbatch import Activation
from lightning_pipe.p2p import ACTIVATION, SKIP, Header, Link, TensorMeta, wait_all
from lightning_pipe.schedule import gpipe_actions
from lightning_pipe.stage import PipelineStage
from lightning_pipe.timeline import BACKWARD, FORWARD, SEND, WAIT, Stamp, StepTimeline


class HandedOff(BaseException):
    """Ends the user's step on the first stage once the pipelined call's micro-batches have been sent on.

    A ``BaseException`` so that a user's ``except Exception`` around the model call does not swallow it.
    """


class PipelineMismatchError(RuntimeError):
    """The stages of one pipeline disagree about what happens in a step."""


@dataclass
class _MicroBatch:
    """What backward needs of one micro-batch on this stage."""

    inputs: tuple[Tensor, ...]  # the stage's inputs as autograd leaves (detached from the sender's graph)
    outputs: tuple[Tensor, ...]  # the stage's outputs, with their graph


@dataclass
class _StepState:
    micro_batches: list[_MicroBatch] = field(default_factory=list)
    sends: list[dist.Work] = field(default_factory=list)  # keep sent tensors alive until the sends complete
    user_input: tuple[Tensor, ...] = ()  # first stage: the pipelined call's input, to back-propagate into
    called: bool = False  # whether the pipelined module was called in this step
    gradient_sender: _OrderedGradientSender | None = None


class PipelineEngine:
    """Drives one stage of a pipeline; one instance per process, attached to its :class:`PipelineStage`."""

    def __init__(
        self,
        stage: PipelineStage,
        num_micro_batches: int,
        checkpoint_mode: CheckpointMode,
        previous: Link | None,
        next: Link | None,
        share_last_output: Callable[[Activation | None], Activation],
        timeline: StepTimeline | None = None,
    ) -> None:
        self.stage = stage
        self.num_micro_batches = num_micro_batches
        self.checkpoint_mode = checkpoint_mode
        self.previous = previous
        self.next = next
        self.share_last_output = share_last_output  # broadcast from the last stage to its pipeline
        self._step = _StepState()
        self._in_step = False
        self._batch_norms = [m for m in stage.modules() if isinstance(m, _BatchNorm)]
        self._deferred_batch_norms = [m for m in self._batch_norms if isinstance(m, DeferredBatchNorm)]
        # Intervals of forward, backward, sends and waits, for the bubble metric and traces (off: no-op calls).
        self.timeline = timeline if timeline is not None else StepTimeline(torch.device("cpu"), enabled=False)
        self._wait_start: Stamp = 0.0
        stage.attach(self)

    @property
    def is_first(self) -> bool:
        return self.previous is None

    @property
    def is_last(self) -> bool:
        return self.next is None

    @property
    def called(self) -> bool:
        """Whether the pipelined module was called in the current step."""
        return self._step.called

    def begin_step(self) -> None:
        """Forget the previous step (its backward may have been skipped)."""
        wait_all(self._step.sends)
        self._step = _StepState()
        self.timeline.begin_step()

    @contextlib.contextmanager
    def user_step(self) -> Iterator[None]:
        """Marks the user's step: a pipelined call inside it is one micro-batched pipeline step."""
        self.begin_step()
        self._in_step = True
        try:
            yield
        finally:
            self._in_step = False

    # ---- forward -------------------------------------------------------------------------------------------------

    def forward(self, value: Activation) -> Activation:
        """The pipelined module's call on the first or the last stage (middle stages use :meth:`relay`)."""
        if not self._in_step:
            return self._forward_outside_step(value)
        if self._step.called:
            raise RuntimeError(
                "the pipelined module was called twice in one step; the gpipe strategy pipelines one call per"
                " step. Call it once (concatenate inputs along the batch dimension if needed)."
            )
        self._step.called = True
        if self.is_first and self.is_last:
            return self._forward_local(value)
        if self.is_first:
            self._forward_first(value)
            raise HandedOff
        return self._forward_last()

    def relay(self) -> bool:
        """Middle stage: receive, compute and send every micro-batch. False when the step has no pipelined call."""
        assert self.previous is not None and self.next is not None
        header = self._recv_header()
        if header.kind == SKIP:
            self._step.sends.append(self.next.send_header(Header(SKIP)))
            return False
        self._step.called = True
        for action in gpipe_actions(header.num_micro_batches, training=False):
            if action.micro_batch > 0:
                header = self._recv_header()
            self._run_and_send(self._receive(header), header.is_tuple, action.micro_batch, header.num_micro_batches)
        return True

    def send_skip(self) -> None:
        """First stage: this step made no pipelined call; tell the stages downstream."""
        assert self.next is not None
        self._step.sends.append(self.next.send_header(Header(SKIP)))

    def drain(self) -> None:
        """Last stage whose step returned without calling the pipelined module: consume what upstream sent."""
        assert self.previous is not None
        header = self.previous.recv_header()
        if header.kind == SKIP:
            return
        for m in range(header.num_micro_batches):
            if m > 0:
                header = self.previous.recv_header()
            _, works = self.previous.recv_tensors(header.tensors)
            wait_all(works)
        raise PipelineMismatchError(
            "the first stage called the pipelined module in this step but the last stage's step returned without"
            " calling it; the step must take the same path on every stage (do not branch on random numbers or"
            " on per-process state before the pipelined call)."
        )

    def _forward_outside_step(self, value: Activation) -> Activation:
        """A call outside a step (Lightning's ModelSummary, a callback calling ``pl_module(x)`` on every rank).

        Every stage of the pipeline must make the call: the input flows through the stages without gradients and
        every stage gets the output, so the caller's code runs on as on one device.
        """
        if self.is_first and self.is_last:
            return self._forward_local(value)
        with torch.no_grad():
            self.begin_step()
            output = None
            if self.is_first:
                self._forward_first(value)
            elif self.is_last:
                output = self._forward_last()
            else:
                self.relay()
            self.end_step()
        return self.share_last_output(output)

    def _forward_local(self, value: Activation) -> Activation:
        """A single stage: micro-batching and re-computation still apply, with nothing to send."""
        chunks = microbatch.split(value, self.num_micro_batches)
        is_tuple = isinstance(value, tuple)
        where = "the input of the pipelined module"
        outputs = [self._run(microbatch.as_tensors(chunk, where), is_tuple, m, len(chunks)) for m, chunk in enumerate(chunks)]
        return microbatch.join(outputs)

    def _forward_first(self, value: Activation) -> None:
        chunks = microbatch.split(value, self.num_micro_batches)
        is_tuple = isinstance(value, tuple)
        where = "the input of the pipelined module"
        self._step.user_input = microbatch.as_tensors(value, where)
        for action in gpipe_actions(len(chunks), training=False):
            chunk = microbatch.as_tensors(chunks[action.micro_batch], where)
            inputs = tuple(_leaf(t, t.requires_grad) for t in chunk)
            self._run_and_send(inputs, is_tuple, action.micro_batch, len(chunks))

    def _forward_last(self) -> Activation:
        assert self.previous is not None
        header = self._recv_header()
        if header.kind == SKIP:
            raise PipelineMismatchError(
                "the last stage called the pipelined module in this step but the first stage's step returned"
                " before calling it; the step must take the same path on every stage (do not branch on random"
                " numbers or on per-process state before the pipelined call)."
            )
        num = header.num_micro_batches
        sender = None
        if torch.is_grad_enabled():
            sender = _OrderedGradientSender(self.previous, num, self._step.sends, self.timeline)
            self._step.gradient_sender = sender
        outputs: list[Activation] = []
        for action in gpipe_actions(num, training=False):
            if action.micro_batch > 0:
                header = self._recv_header()
            inputs = self._receive(header)
            if sender is not None:
                sender.watch(action.micro_batch, inputs)
            outputs.append(self._run(inputs, header.is_tuple, action.micro_batch, num))
        joined = microbatch.join(outputs)
        if sender is not None and self.timeline.enabled:
            sender.watch_output(joined)
        return joined

    def _recv_header(self) -> Header:
        """The next activation header from the previous stage; the wait for it starts now."""
        assert self.previous is not None
        self._wait_start = self.timeline.now()
        return self.previous.recv_header()

    def _receive(self, header: Header) -> tuple[Tensor, ...]:
        assert self.previous is not None
        buffers, works = self.previous.recv_tensors(header.tensors)
        wait_all(works)
        self.timeline.add(WAIT, header.micro_batch, self._wait_start)
        grad = torch.is_grad_enabled()
        return tuple(_leaf(t, grad and meta.requires_grad) for t, meta in zip(buffers, header.tensors))

    def _run(self, inputs: tuple[Tensor, ...], is_tuple: bool, m: int, num: int) -> Activation:
        """This stage's layers on micro-batch ``m`` of ``num``, re-computed in backward when the mode says so."""
        run = partial(self.stage.run_layers, is_tuple)
        start = self.timeline.now()
        if torch.is_grad_enabled() and self._checkpointed(m, num):
            if self._batch_norms or self.timeline.enabled:
                context_fn = partial(self._recomputation_contexts, m)
                out = checkpoint(run, *inputs, use_reentrant=False, context_fn=context_fn)
            else:
                out = checkpoint(run, *inputs, use_reentrant=False)
        else:
            out = run(*inputs)
        self.timeline.add(FORWARD, m, start)
        if m == num - 1:
            for batch_norm in self._deferred_batch_norms:
                batch_norm.commit()  # the mini-batch is complete: update the running statistics once
        return out

    def _recomputation_contexts(
        self, m: int
    ) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """The forward runs normally; its re-computation in backward must not update BatchNorm statistics again,
        and is recorded on the timeline."""
        return contextlib.nullcontext(), self._recomputing(m)

    @contextlib.contextmanager
    def _recomputing(self, m: int) -> Iterator[None]:
        with self.timeline.recomputing(m), _unchanged_running_stats(self._batch_norms):
            yield

    def _run_and_send(self, inputs: tuple[Tensor, ...], is_tuple: bool, m: int, num: int) -> None:
        """First and middle stages: run micro-batch ``m``, keep what its backward needs, send the output on."""
        assert self.next is not None
        out = self._run(inputs, is_tuple, m, num)
        outputs = microbatch.as_tensors(out, f"the output of pipeline stage {self.stage.stage_index}")
        if torch.is_grad_enabled():
            self._step.micro_batches.append(_MicroBatch(inputs, outputs))
        start = self.timeline.now()
        metas = tuple(TensorMeta(tuple(t.shape), t.dtype, t.requires_grad) for t in outputs)
        self._step.sends.append(self.next.send_header(Header(ACTIVATION, m, num, metas, isinstance(out, tuple))))
        self._step.sends.extend(self.next.send_tensors(tuple(t.detach() for t in outputs)))
        self.timeline.add(SEND, m, start)

    def _checkpointed(self, m: int, num: int) -> bool:
        if self.checkpoint_mode == "always":
            return True
        if self.checkpoint_mode == "except_last":
            return m < num - 1
        return False

    # ---- backward ------------------------------------------------------------------------------------------------

    def backward(self) -> None:
        """First and middle stages: back-propagate every micro-batch with the gradients the next stage sends."""
        assert self.next is not None
        step = self._step
        # Post every gradient receive up front, in the order the next stage sends them (reverse micro-batch order).
        backwards = [a.micro_batch for a in gpipe_actions(len(step.micro_batches)) if a.kind == "backward"]
        pending = {}
        for m in backwards:
            outputs = [t for t in step.micro_batches[m].outputs if t.requires_grad]
            metas = tuple(TensorMeta(tuple(t.shape), t.dtype, False) for t in outputs)
            pending[m] = (outputs, *self.next.recv_tensors(metas))
        timeline = self.timeline
        for m in backwards:
            outputs, grads, works = pending.pop(m)
            start = timeline.now()
            wait_all(works)
            timeline.add(WAIT, m, start)
            start = timeline.now()
            if outputs:
                torch.autograd.backward(outputs, list(grads))
            timeline.add(BACKWARD, m, start)
            if not self.is_first:
                assert self.previous is not None
                start = timeline.now()
                step.sends.extend(self.previous.send_tensors(_input_gradients(step.micro_batches[m].inputs)))
                timeline.add(SEND, m, start)
        if self.is_first:
            self._backward_into_user_graph()
        self.end_step()

    def finish_last_backward(self) -> None:
        """Last stage, after ``loss.backward()``: send the gradients no hook sent (inputs the loss did not use)."""
        if self._step.gradient_sender is not None:
            self._step.gradient_sender.flush(force=True)
        self.end_step()

    def end_step(self) -> None:
        wait_all(self._step.sends)
        self._step = _StepState()

    def _backward_into_user_graph(self) -> None:
        """First stage: carry the micro-batch input gradients into the user's code before the pipelined call."""
        step = self._step
        targets, grads = [], []
        for i, original in enumerate(step.user_input):
            if original.requires_grad:
                parts = [_grad_or_zeros(mb.inputs[i]) for mb in step.micro_batches]
                targets.append(original)
                grads.append(torch.cat(parts) if len(parts) > 1 else parts[0])
        if targets:
            torch.autograd.backward(targets, grads)


class _OrderedGradientSender:
    """Last stage: sends each micro-batch's input gradients upstream in reverse micro-batch order.

    Autograd fires the gradient hooks as it reaches each micro-batch (normally in reverse order, since the loss is
    computed on the concatenation); a fixed order lets the receiver post its receives before anything arrives.
    """

    def __init__(self, link: Link, num_micro_batches: int, sends: list[dist.Work], timeline: StepTimeline) -> None:
        self.link = link
        self.sends = sends
        self.timeline = timeline
        self.mark: Stamp | None = None  # where the backward of the next micro-batch to finish began
        self.inputs: dict[int, tuple[Tensor, ...]] = {}
        self.grads: dict[int, tuple[Tensor, ...]] = {}
        self.next_to_send = num_micro_batches - 1

    def watch(self, m: int, inputs: tuple[Tensor, ...]) -> None:
        self.inputs[m] = inputs
        needs_grad = [t for t in inputs if t.requires_grad]
        if needs_grad:
            torch.autograd.graph.register_multi_grad_hook(needs_grad, partial(self._ready, m))

    def watch_output(self, joined: Activation) -> None:
        """Mark when the gradient reaches the pipelined output: the pipeline's backward starts there."""
        needs_grad = [t for t in microbatch.as_tensors(joined, "the pipelined output") if t.requires_grad]
        if needs_grad:
            torch.autograd.graph.register_multi_grad_hook(needs_grad, self._backward_begins, mode="any")

    def _backward_begins(self, _grad: Tensor) -> None:
        self.mark = self.timeline.now()

    def _ready(self, m: int, grads: tuple[Tensor | None, ...]) -> None:
        # Autograd runs the micro-batches' backwards one after another: this one ran since the last mark.
        if self.mark is not None:
            self.timeline.add(BACKWARD, m, self.mark)
        self.grads[m] = tuple(g if g is not None else torch.zeros_like(t) for g, t in zip(grads, self._needing(m)))
        self.flush()
        self.mark = self.timeline.now() if self.mark is not None else None

    def flush(self, force: bool = False) -> None:
        while self.next_to_send >= 0 and (force or self.next_to_send in self.grads):
            m = self.next_to_send
            grads = self.grads.pop(m, None)
            if grads is None:  # the loss did not reach this micro-batch: its gradient is zero
                grads = tuple(torch.zeros_like(t) for t in self._needing(m))
            start = self.timeline.now()
            self.sends.extend(self.link.send_tensors(grads))
            self.timeline.add(SEND, m, start)
            self.next_to_send -= 1

    def _needing(self, m: int) -> list[Tensor]:
        return [t for t in self.inputs.get(m, ()) if t.requires_grad]


@contextlib.contextmanager
def _unchanged_running_stats(batch_norms: list[_BatchNorm]) -> Iterator[None]:
    saved = [(bn, [buffer.clone() for buffer in bn.buffers()]) for bn in batch_norms]
    try:
        yield
    finally:
        with torch.no_grad():
            for bn, buffers in saved:
                for buffer, value in zip(bn.buffers(), buffers):
                    buffer.copy_(value)


def _leaf(tensor: Tensor, requires_grad: bool) -> Tensor:
    """A stage input as an autograd leaf, so that each micro-batch's backward stops at the stage boundary."""
    leaf = tensor.detach()
    if requires_grad and leaf.is_floating_point():
        leaf.requires_grad_(True)
    return leaf


def _input_gradients(inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    return tuple(_grad_or_zeros(t) for t in inputs if t.requires_grad)


def _grad_or_zeros(tensor: Tensor) -> Tensor:
    return tensor.grad if tensor.grad is not None else torch.zeros_like(tensor)

