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
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import FunctionCtx
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

from lightning_pipe import microbatch
from lightning_pipe.batchnorm import DeferredBatchNorm
from lightning_pipe.microbatch import Activation
from lightning_pipe.p2p import ACTIVATION, SKIP, Header, Link, PendingHeader, PostedTensors, TensorMeta
from lightning_pipe.schedule import gpipe_actions
from lightning_pipe.settings import RecomputeMode
from lightning_pipe.stage import PipelineStage
from lightning_pipe.trace.timeline import BACKWARD, FORWARD, SEND, WAIT, Stamp, StepTimeline


class HandedOff(BaseException):
    """Ends the user's step on the first stage once the pipelined call's micro-batches have been sent on.

    A ``BaseException`` so that a user's ``except Exception`` around the model call does not swallow it.
    """


class PipelineMismatchError(RuntimeError):
    """The stages of one pipeline disagree about what happens in a step."""


# Activation sends of this many micro-batches may be in flight; older ones are waited for and released (with the
# sent outputs they hold). The next stage receives micro-batch m before it asks for m + 1, so waiting for the send
# of m - 1 after computing m + 1 costs nothing unless that stage is far behind.
_SENDS_IN_FLIGHT = 2


@dataclass
class _MicroBatch:
    """What backward needs of one micro-batch on this stage."""

    inputs: tuple[Tensor, ...]  # the stage's inputs as autograd leaves (detached from the sender's graph)
    # Where the outputs that need a gradient enter the stage's graph, and their shapes: their data is not kept (once
    # sent, an output's values are not needed by backward unless its own graph saved them).
    outputs: tuple[GradientEdge, ...]
    output_metas: tuple[TensorMeta, ...]


@dataclass
class _StepState:
    micro_batches: list[_MicroBatch] = field(default_factory=list)
    sends: list[dist.Work] = field(default_factory=list)  # to the previous stage; kept until the sends complete
    activation_sends: deque[list[dist.Work]] = field(default_factory=deque)  # to the next stage, oldest first
    sent_metas: tuple[TensorMeta, ...] | None = None  # shapes of the last micro-batch sent on in this step
    user_input: tuple[Tensor, ...] = ()  # first stage: the pipelined call's input, to back-propagate into
    called: bool = False  # whether the pipelined module was called in this step
    gradient_sender: _OrderedGradientSender | None = None


class PipelineEngine:
    """Drives one stage of a pipeline; one instance per process, attached to its :class:`PipelineStage`."""

    def __init__(
        self,
        stage: PipelineStage,
        num_micro_batches: int,
        checkpoint_mode: RecomputeMode,
        previous: Link | None,
        next: Link | None,
        share_last_output: Callable[[Activation | None], Activation],
        timeline: StepTimeline | None = None,
        rendezvous: Callable[[], None] = lambda: None,
    ) -> None:
        self.stage = stage
        self.num_micro_batches = num_micro_batches
        self.checkpoint_mode = checkpoint_mode
        self.previous = previous
        self.next = next
        self.share_last_output = share_last_output  # broadcast from the last stage to its pipeline
        self.rendezvous = rendezvous  # fails fast unless every stage of the pipeline makes the call
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
        self._wait_sends()
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
            self._step.activation_sends.append([self.next.send_header(Header(SKIP))])
            return False
        self._step.called = True
        for header, inputs in self._received(header):
            self._run_and_send(inputs, header.is_tuple, header.micro_batch, header.num_micro_batches)
        self._wait_sends()  # see _forward_first
        return True

    def send_skip(self) -> None:
        """First stage: this step made no pipelined call; tell the stages downstream."""
        assert self.next is not None
        self._step.activation_sends.append([self.next.send_header(Header(SKIP))])

    def drain(self) -> None:
        """Last stage whose step returned without calling the pipelined module: consume what upstream sent."""
        assert self.previous is not None
        header = self.previous.recv_header()
        if header.kind == SKIP:
            return
        for _ in self._received(header):
            pass
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
        self.rendezvous()
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
        outputs = [
            self._run(microbatch.as_tensors(chunk, where), is_tuple, m, len(chunks)) for m, chunk in enumerate(chunks)
        ]
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
        # Free: nothing is left to do before the gradients come back. The sent outputs are released now, so that
        # between forward and backward this stage keeps only what backward needs.
        self._wait_sends()

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
        for header, inputs in self._received(header):
            if sender is not None:
                inputs = sender.watch(header.micro_batch, inputs)
            outputs.append(self._run(inputs, header.is_tuple, header.micro_batch, num))
        joined = microbatch.join(outputs)
        if sender is not None and self.timeline.enabled:
            sender.watch_output(joined)
        return joined

    def _recv_header(self) -> Header:
        """The next activation header from the previous stage; the wait for it starts now."""
        assert self.previous is not None
        self._wait_start = self.timeline.now()
        return self.previous.recv_header()

    def _received(self, header: Header) -> Iterator[tuple[Header, tuple[Tensor, ...]]]:
        """Each micro-batch's header and inputs as they arrive, starting from the first micro-batch's header.

        The next micro-batch's header and tensors are received while this stage computes: their receives are posted
        before a micro-batch is handed out, the tensors' with this micro-batch's shapes (the sender corrects a wrong
        guess, see :meth:`Link.send_activation`). Micro-batch ``m`` is received into slot ``m``'s buffers, reused from
        step to step.
        """
        link = self.previous
        assert link is not None
        grad = torch.is_grad_enabled()
        num = header.num_micro_batches
        pending: PendingHeader | None = None
        posted: PostedTensors | None = None
        for m in range(num):
            if pending is not None:
                self._wait_start = self.timeline.now()
                header = pending.wait()
            received = link.recv_activation(header, m, posted)
            if m + 1 < num:
                pending = link.post_header(m + 1)
                posted = link.post_activation(header.tensors, m + 1)
            link.wait(received.works, "the activation", m)
            self.timeline.add(WAIT, m, self._wait_start)
            inputs = tuple(_leaf(t, grad and meta.requires_grad) for t, meta in zip(received.buffers, header.tensors))
            yield header, inputs

    def _run(self, inputs: tuple[Tensor, ...], is_tuple: bool, m: int, num: int) -> Activation:
        """This stage's layers on micro-batch ``m`` of ``num``, re-computed in backward when the mode says so."""
        run = partial(self.stage.run_layers, is_tuple)
        start = self.timeline.now()
        try:
            if torch.is_grad_enabled() and self._checkpointed(m, num):
                if self._batch_norms or self.timeline.enabled:
                    context_fn = partial(self._recomputation_contexts, m)
                    out = checkpoint(run, *inputs, use_reentrant=False, context_fn=context_fn)
                else:
                    out = checkpoint(run, *inputs, use_reentrant=False)
            else:
                out = run(*inputs)
        except Exception as error:  # the user's error, unchanged, with where in the pipeline it happened
            error.add_note(self._where_it_failed(error, inputs, m, num))
            raise
        self.timeline.add(FORWARD, m, start)
        if m == num - 1:
            for batch_norm in self._deferred_batch_norms:
                batch_norm.commit()  # the mini-batch is complete: update the running statistics once
        return out

    def _where_it_failed(self, error: Exception, inputs: tuple[Tensor, ...], m: int, num: int) -> str:
        """A note for an error raised by this stage's layers: the stage, its layers, the micro-batch, and, for a dtype
        error on a received input, the stage that sent that dtype."""
        stage = self.stage
        layers = f"{stage.layer_range.start}..{stage.layer_range.stop - 1}"
        note = f"raised by pipeline stage {stage.stage_index} (layers {layers}) on micro-batch {m} of {num}"
        received = sorted({str(t.dtype) for t in inputs if t.is_floating_point()})
        own = sorted({str(p.dtype) for p in stage.parameters() if p.is_floating_point()})
        if not self.is_first and ("dtype" in str(error) or "scalar type" in str(error)) and received != own:
            note += (
                f"; it received {', '.join(received)} from stage {stage.stage_index - 1} but its parameters are"
                f" {', '.join(own)}: give every stage the same dtype (convert the whole model, e.g. model.double(),"
                " or set the Trainer's precision)"
            )
        return note

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
        stage = self.stage.stage_index
        outputs = microbatch.as_tensors(out, f"the output of pipeline stage {stage} for micro-batch {m}")
        microbatch.check_batch_kept(inputs, outputs, stage, m)
        metas = tuple(TensorMeta(tuple(t.shape), t.dtype, t.requires_grad) for t in outputs)
        if torch.is_grad_enabled():
            edges = tuple(get_gradient_edge(t) for t in outputs if t.requires_grad)
            grad_metas = tuple(TensorMeta(meta.shape, meta.dtype, False) for meta in metas if meta.requires_grad)
            self._step.micro_batches.append(_MicroBatch(inputs, edges, grad_metas))
        start = self.timeline.now()
        sends = self._step.activation_sends
        header = Header(ACTIVATION, m, num, metas, isinstance(out, tuple))
        # The next stage posted this micro-batch's receive with the previous micro-batch's shapes (see _received).
        sends.append(self.next.send_activation(header, tuple(t.detach() for t in outputs), self._step.sent_metas))
        self._step.sent_metas = metas
        while len(sends) > _SENDS_IN_FLIGHT:
            self.next.wait(sends.popleft(), "the activations", sending=True)
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
        self._wait_sends()  # the activations were received long ago: release the sent outputs
        # Gradients come in the order the next stage sends them (reverse micro-batch order). Each receive is posted
        # one micro-batch ahead, into one of two buffers used in turn, so it arrives during the previous backward.
        backwards = [a.micro_batch for a in gpipe_actions(len(step.micro_batches)) if a.kind == "backward"]

        link = self.next

        def post(i: int) -> tuple[tuple[Tensor, ...], list[dist.Work]]:
            return link.recv_tensors(step.micro_batches[backwards[i]].output_metas, slot=i % 2)

        pending = post(0) if backwards else None
        timeline = self.timeline
        for i, m in enumerate(backwards):
            assert pending is not None
            grads, works = pending
            pending = post(i + 1) if i + 1 < len(backwards) else None
            start = timeline.now()
            link.wait(works, "the gradient", m)
            timeline.add(WAIT, m, start)
            start = timeline.now()
            if step.micro_batches[m].outputs:
                torch.autograd.backward(step.micro_batches[m].outputs, list(grads))
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
        self._wait_sends()
        self._step = _StepState()

    def _wait_sends(self) -> None:
        step = self._step
        # Sends to the next stage (activations, skips) and to the previous one (gradients), each named if it fails.
        while step.activation_sends:
            assert self.next is not None
            self.next.wait(step.activation_sends.popleft(), "the activations", sending=True)
        if step.sends:
            assert self.previous is not None
            self.previous.wait(step.sends, "the gradients", sending=True)
        step.sends.clear()

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

    def watch(self, m: int, inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """Micro-batch ``m``'s inputs as the layers should use them: their gradients all reach :meth:`_ready`.

        The gradients are caught on their way to the inputs (by :class:`_CatchGradients`), so none is accumulated
        into, or copied to, an input's ``.grad``.
        """
        self.inputs[m] = inputs
        needing = [i for i, t in enumerate(inputs) if t.requires_grad]
        if not needing:
            return inputs
        caught = _CatchGradients.apply(partial(self._ready, m), *(inputs[i] for i in needing))
        watched = list(inputs)
        for i, tensor in zip(needing, caught):
            watched[i] = tensor
        return tuple(watched)

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


class _CatchGradients(torch.autograd.Function):
    """Identity in forward; in backward hands all its outputs' gradients to ``ready`` at once and stops there.

    Autograd calls its backward once every gradient of the micro-batch is known (the ones the loss does not reach
    as zeros), which is when they can be sent upstream.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx, ready: Callable[[tuple[Tensor, ...]], None], *inputs: Tensor
    ) -> tuple[Tensor, ...]:
        ctx.ready = ready  # type: ignore[attr-defined]
        return tuple(t.view_as(t) for t in inputs)

    @staticmethod
    def backward(ctx: FunctionCtx, *grads: Tensor) -> tuple[None, ...]:  # type: ignore[override]
        ctx.ready(grads)  # type: ignore[attr-defined]
        return (None,) * (len(grads) + 1)


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

