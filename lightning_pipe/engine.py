"""Executes a stage's schedule: micro-batch forwards and backwards with their sends and receives.

The engine knows nothing of Lightning or of the user's step: :mod:`lightning_pipe.runtime` decides which of its
phases this rank runs, and when. A stage's actions come from a schedule (:mod:`lightning_pipe.schedule`); the
forward phase runs inside the pipelined call, the backward phase when the loss's backward reaches this stage:

* :meth:`PipelineEngine.forward_first`, :meth:`~PipelineEngine.relay`, :meth:`~PipelineEngine.forward_last` and
  :meth:`~PipelineEngine.forward_local` execute the forward phase as the first, a middle, the last or the only stage.
* :meth:`PipelineEngine.backward` executes the backward phase on the first and middle stages: receive each
  micro-batch's output gradients, back-propagate, send the input gradients upstream. On the last stage the user's
  ``loss.backward()`` runs the backwards; the gradients caught at the stage's inputs are sent upstream in the
  schedule's order (:class:`_OrderedGradientSender`).
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
from lightning_pipe.random_streams import StageRandomStreams
from lightning_pipe.schedule import Action, PipelineSchedule, phases
from lightning_pipe.settings import RecomputeMode
from lightning_pipe.stage import StageBlocks
from lightning_pipe.trace.timeline import BACKWARD, FORWARD, SEND, WAIT, Stamp, StepTimeline


class PipelineMismatchError(RuntimeError):
    """The stages of one pipeline disagree about what happens in a step."""


# Activation sends of this many micro-batches may be in flight; older ones are waited for and released (with the
# sent outputs they hold). The next stage receives micro-batch m before it asks for m + 1, so waiting for the send
# of m - 1 after computing m + 1 costs nothing unless that stage is far behind.
_SENDS_IN_FLIGHT = 2
_WHERE_INPUT = "the input of the pipelined module"
_SAME_PATH = (
    "; the step must take the same path on every stage (do not branch on random numbers or on per-process state"
    " before the pipelined call)."
)
_SKIPPED_UPSTREAM = (
    "{stage} called the pipelined module in this step but the first stage's step returned before calling it" + _SAME_PATH
)
_SKIPPED_HERE = "the first stage called the pipelined module in this step but {stage}'s step returned without calling it" + _SAME_PATH


@dataclass
class _MicroBatch:
    """What backward needs of one micro-batch on this stage."""

    inputs: tuple[Tensor, ...]  # the stage's inputs as autograd leaves (detached from the sender's graph)
    # Where the outputs that need a gradient enter the stage's graph, and their shapes: their data is not kept (once
    # sent, an output's values are not needed by backward unless its own graph saved them).
    outputs: tuple[GradientEdge, ...] = ()
    output_metas: tuple[TensorMeta, ...] = ()


@dataclass
class _StepState:
    """What one step leaves for the next phase: the micro-batches backward needs, the sends still in flight."""

    micro_batches: dict[int, _MicroBatch] = field(default_factory=dict)
    backwards: list[Action] = field(default_factory=list)  # the backward phase of this step's schedule
    sends: list[dist.Work] = field(default_factory=list)  # to the previous stage; kept until the sends complete
    activation_sends: deque[list[dist.Work]] = field(default_factory=deque)  # to the next stage, oldest first
    sent_metas: tuple[TensorMeta, ...] | None = None  # shapes of the last micro-batch sent on in this step
    user_input: tuple[Tensor, ...] = ()  # first stage: the pipelined call's input, to back-propagate into
    gradient_sender: _OrderedGradientSender | None = None


class PipelineEngine:
    """Runs one stage's share of each step; one instance per process.

    ``previous`` and ``next`` are the links to the neighbouring stages (``None`` at the ends of the pipeline).
    ``random_streams``, given with more than one stage, runs each micro-batch's forward on a random stream of its own.
    """

    def __init__(
        self,
        layers: StageBlocks,
        num_micro_batches: int,
        recompute: RecomputeMode,
        previous: Link | None,
        next: Link | None,
        schedule: PipelineSchedule,
        timeline: StepTimeline | None = None,
        random_streams: StageRandomStreams | None = None,
    ) -> None:
        self.layers = layers
        self.num_micro_batches = num_micro_batches
        self.recompute = recompute
        self.previous = previous
        self.next = next
        if schedule.per_micro_batch or schedule.virtual_stages != 1:
            raise ValueError(
                f"schedule={schedule.name!r} needs a loss per micro-batch or several chunks per stage, which this"
                " engine does not run yet; use schedule='gpipe'."
            )
        self.schedule = schedule
        self.random_streams = random_streams
        self._step = _StepState()
        self._batch_norms = [m for m in layers.modules() if isinstance(m, _BatchNorm)]
        self._deferred_batch_norms = [m for m in self._batch_norms if isinstance(m, DeferredBatchNorm)]
        # Intervals of forward, backward, sends and waits, for the bubble metric and traces (off: no-op calls).
        self.timeline = timeline if timeline is not None else StepTimeline(torch.device("cpu"), enabled=False)
        self._wait_start: Stamp = 0.0

    @property
    def is_first(self) -> bool:
        return self.previous is None

    @property
    def is_last(self) -> bool:
        return self.next is None

    def begin_step(self) -> None:
        """Forget the previous step (its backward may have been skipped)."""
        self._wait_sends()
        self._step = _StepState()
        self.timeline.begin_step()
        if self.random_streams is not None:
            self.random_streams.begin_step()

    def _actions(self, num_micro_batches: int) -> list[Action]:
        """This step's forward phase; its backward phase is kept for :meth:`backward`."""
        stage, num_stages = self.layers.stage_index, self.layers.num_stages
        actions = self.schedule.stage_actions(stage, num_stages, num_micro_batches, 1, self.recompute)
        forwards, backwards = phases(actions, num_micro_batches)
        self._step.backwards = backwards if torch.is_grad_enabled() else []
        return forwards

    # ---- forward phase -------------------------------------------------------------------------------------------

    def forward_local(self, value: Activation) -> Activation:
        """The only stage: micro-batching and re-computation still apply, with nothing to send."""
        chunks = microbatch.split(value, self.num_micro_batches)
        is_tuple = isinstance(value, tuple)
        outputs: dict[int, Activation] = {}
        for action in self._actions(len(chunks)):
            m = action.micro_batch
            outputs[m] = self._run(microbatch.as_tensors(chunks[m], _WHERE_INPUT), is_tuple, action, len(chunks))
        return microbatch.join([outputs[m] for m in range(len(chunks))])

    def forward_first(self, value: Activation) -> None:
        """The first stage: split the pipelined call's input into micro-batches, run and send each one."""
        chunks = microbatch.split(value, self.num_micro_batches)
        is_tuple = isinstance(value, tuple)
        self._step.user_input = microbatch.as_tensors(value, _WHERE_INPUT)
        inputs = {m: tuple(_leaf(t, t.requires_grad) for t in microbatch.as_tensors(c, _WHERE_INPUT)) for m, c in enumerate(chunks)}
        self._execute_forwards(self._actions(len(chunks)), inputs, is_tuple, len(chunks))
        # Free: nothing is left to do before the gradients come back. The sent outputs are released now, so that
        # between forward and backward this stage keeps only what backward needs.
        self._wait_sends()

    def relay(self) -> None:
        """A middle stage: receive, run and send every micro-batch."""
        header = self._recv_header()
        if header.kind == SKIP:
            raise PipelineMismatchError(_SKIPPED_UPSTREAM.format(stage=f"stage {self.layers.stage_index}"))
        num = header.num_micro_batches
        self._execute_forwards(self._actions(num), {}, header.is_tuple, num, header)
        self._wait_sends()  # see forward_first

    def pass_skip(self) -> None:
        """A middle stage whose step returned before reaching its blocks: pass the first stage's skip on."""
        assert self.next is not None
        self.drain(called=f"stage {self.layers.stage_index}")
        self._step.activation_sends.append([self.next.send_header(Header(SKIP))])

    def forward_last(self) -> Activation:
        """The last stage: receive and run every micro-batch; their joined output is the pipelined call's result."""
        assert self.previous is not None
        header = self._recv_header()
        if header.kind == SKIP:
            raise PipelineMismatchError(_SKIPPED_UPSTREAM.format(stage="the last stage"))
        num = header.num_micro_batches
        forwards = self._actions(num)
        sender = None
        if torch.is_grad_enabled():
            order = [a.micro_batch for a in self._step.backwards if a.kind == "backward"]
            sender = _OrderedGradientSender(self.previous, order, self._step.sends, self.timeline)
            self._step.gradient_sender = sender
        outputs = self._execute_forwards(forwards, {}, header.is_tuple, num, header, sender)
        joined = microbatch.join([outputs[m] for m in range(num)])
        if sender is not None and self.timeline.enabled:
            sender.watch_output(joined)
        return joined

    def send_skip(self) -> None:
        """First stage: this step made no pipelined call; tell the stages downstream."""
        assert self.next is not None
        self._step.activation_sends.append([self.next.send_header(Header(SKIP))])

    def drain(self, called: str = "the last stage") -> None:
        """A stage whose step returned without reaching its blocks: the previous stage must have skipped too."""
        assert self.previous is not None
        header = self.previous.recv_header()
        if header.kind == SKIP:
            return
        for _ in self._receiving(header, list(range(header.num_micro_batches))):
            pass
        raise PipelineMismatchError(_SKIPPED_HERE.format(stage=called))

    def _execute_forwards(
        self,
        actions: list[Action],
        inputs: dict[int, tuple[Tensor, ...]],
        is_tuple: bool,
        num: int,
        header: Header | None = None,
        sender: _OrderedGradientSender | None = None,
    ) -> dict[int, Activation]:
        """Run the forward phase's actions; ``inputs`` holds the first stage's micro-batches, the others arrive with
        ``recv`` actions (from ``header``, the first micro-batch's, on). The outputs that were not sent on."""
        received = None
        if header is not None:
            received = self._receiving(header, [a.micro_batch for a in actions if a.kind == "recv"])
        outputs: dict[int, Activation] = {}
        for action in actions:
            m = action.micro_batch
            if action.kind == "recv":
                assert received is not None
                header_m, tensors = next(received)
                is_tuple = header_m.is_tuple
                inputs[m] = sender.watch(m, tensors) if sender is not None else tensors
            elif action.kind == "forward":
                outputs[m] = self._run(inputs.pop(m), is_tuple, action, num)
            else:
                self._send(outputs.pop(m), m, num)
        return outputs

    def _recv_header(self) -> Header:
        """The next activation header from the previous stage; the wait for it starts now."""
        assert self.previous is not None
        self._wait_start = self.timeline.now()
        return self.previous.recv_header()

    def _receiving(self, header: Header, order: list[int]) -> Iterator[tuple[Header, tuple[Tensor, ...]]]:
        """Each micro-batch's header and inputs as they arrive, in ``order``, from the first one's ``header`` on.

        The next micro-batch's header and tensors are received while this stage computes: their receives are posted
        before a micro-batch is handed out, the tensors' with this micro-batch's shapes (the sender corrects a wrong
        guess, see :meth:`Link.send_activation`). Micro-batch ``m`` is received into slot ``m``'s buffers, reused from
        step to step.
        """
        link = self.previous
        assert link is not None
        grad = torch.is_grad_enabled()
        pending: PendingHeader | None = None
        posted: PostedTensors | None = None
        for i, m in enumerate(order):
            if pending is not None:
                self._wait_start = self.timeline.now()
                header = pending.wait()
            received = link.recv_activation(header, m, posted)
            if i + 1 < len(order):
                pending = link.post_header(order[i + 1])
                posted = link.post_activation(header.tensors, order[i + 1])
            link.wait(received.works, "the activation", m)
            self.timeline.add(WAIT, m, self._wait_start)
            inputs = tuple(_leaf(t, grad and meta.requires_grad) for t, meta in zip(received.buffers, header.tensors))
            yield header, inputs

    def _run(self, inputs: tuple[Tensor, ...], is_tuple: bool, action: Action, num: int) -> Activation:
        """This stage's layers on one micro-batch, re-computed in backward when the action says so."""
        m = action.micro_batch
        run = partial(self.layers.run_micro_batch, m, num, is_tuple)
        if self.random_streams is not None:  # inside what re-computation re-runs: its dropout draws the same mask
            run = self.random_streams.seeded_run(run, m)
        start = self.timeline.now()
        try:
            if torch.is_grad_enabled() and action.recompute:
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
        if not self.is_last:  # what travels on is sent: check it, and keep what its backward needs
            out = self.layers.travelling(out)
            stage = self.layers.stage_index
            outputs = microbatch.as_tensors(out, f"the output of pipeline stage {stage} for micro-batch {m}")
            microbatch.check_batch_kept(inputs, outputs, stage, m)
            if torch.is_grad_enabled():
                self._keep_for_backward(m, inputs, outputs)
        if m == num - 1:
            for batch_norm in self._deferred_batch_norms:
                batch_norm.commit()  # the mini-batch is complete: update the running statistics once
        return out

    def _keep_for_backward(self, m: int, inputs: tuple[Tensor, ...], outputs: tuple[Tensor, ...]) -> None:
        """Where the outputs' gradients re-enter this stage's graph: all that backward needs of micro-batch ``m``."""
        edges = tuple(get_gradient_edge(t) for t in outputs if t.requires_grad)
        metas = tuple(TensorMeta(tuple(t.shape), t.dtype, False) for t in outputs if t.requires_grad)
        self._step.micro_batches[m] = _MicroBatch(inputs, edges, metas)

    def _where_it_failed(self, error: Exception, inputs: tuple[Tensor, ...], m: int, num: int) -> str:
        """A note for an error raised by this stage's layers: the stage, its layers, the micro-batch, and, for a dtype
        error on a received input, the stage that sent that dtype."""
        layers = self.layers
        span = f"{layers.layer_range.start}..{layers.layer_range.stop - 1}"
        note = f"raised by pipeline stage {layers.stage_index} (layers {span}) on micro-batch {m} of {num}"
        if layers.region.container is None:
            note += f" ({layers.describe_layers()})"
        received = sorted({str(t.dtype) for t in inputs if t.is_floating_point()})
        own = sorted({str(p.dtype) for p in layers.parameters() if p.is_floating_point()})
        if not self.is_first and ("dtype" in str(error) or "scalar type" in str(error)) and received != own:
            note += (
                f"; it received {', '.join(received)} from stage {layers.stage_index - 1} but its parameters are"
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

    def _send(self, out: Activation, m: int, num: int) -> None:
        """Send micro-batch ``m``'s output to the next stage, keeping at most ``_SENDS_IN_FLIGHT`` sends in flight."""
        assert self.next is not None
        outputs = microbatch.as_tensors(out, "a stage output")  # checked in _run
        metas = tuple(TensorMeta(tuple(t.shape), t.dtype, t.requires_grad) for t in outputs)
        start = self.timeline.now()
        sends = self._step.activation_sends
        header = Header(ACTIVATION, m, num, metas, isinstance(out, tuple))
        # The next stage posted this micro-batch's receive with the previous micro-batch's shapes (see _receiving).
        sends.append(self.next.send_activation(header, tuple(t.detach() for t in outputs), self._step.sent_metas))
        self._step.sent_metas = metas
        while len(sends) > _SENDS_IN_FLIGHT:
            self.next.wait(sends.popleft(), "the activations", sending=True)
        self.timeline.add(SEND, m, start)

    # ---- backward phase ------------------------------------------------------------------------------------------

    def backward(self) -> None:
        """First and middle stages: the backward phase, with the gradients the next stage sends."""
        assert self.next is not None
        step = self._step
        self._wait_sends()  # the activations were received long ago: release the sent outputs
        link, timeline = self.next, self.timeline
        # Each gradient receive is posted one ahead, into one of two buffers used in turn, so that it arrives during
        # the previous micro-batch's backward.
        # (A buffer is reused two receives later: each micro-batch's backward runs before the receive after next.)
        receives = [a.micro_batch for a in step.backwards if a.kind == "recv_grad"]
        posted: dict[int, tuple[tuple[Tensor, ...], list[dist.Work]]] = {}

        def post(i: int) -> None:
            if i < len(receives):
                m = receives[i]
                posted[m] = link.recv_tensors(step.micro_batches[m].output_metas, slot=i % 2)

        post(0)
        grads: dict[int, tuple[Tensor, ...]] = {}
        for action in step.backwards:
            m, start = action.micro_batch, timeline.now()
            if action.kind == "recv_grad":
                post(receives.index(m) + 1)
                tensors, works = posted.pop(m)
                link.wait(works, "the gradient", m)
                grads[m] = tensors
                timeline.add(WAIT, m, start)
            elif action.kind == "backward":
                if step.micro_batches[m].outputs:
                    torch.autograd.backward(step.micro_batches[m].outputs, list(grads.pop(m)))
                timeline.add(BACKWARD, m, start)
            else:
                assert self.previous is not None
                step.sends.extend(self.previous.send_tensors(_input_gradients(step.micro_batches[m].inputs)))
                timeline.add(SEND, m, start)
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
        """Carry the gradients that stopped at this stage's leaves into the model's code, in one backward: the first
        stage's input (joined over the micro-batches) and every stage's side arguments (masks, position embeddings,
        an encoder's output), which the user's code before the pipelined blocks computed."""
        step = self._step
        targets, grads = [], []
        micro_batches = [step.micro_batches[m] for m in sorted(step.micro_batches)]
        for i, original in enumerate(step.user_input):
            if original.requires_grad:
                parts = [_grad_or_zeros(mb.inputs[i]) for mb in micro_batches]
                targets.append(original)
                grads.append(torch.cat(parts) if len(parts) > 1 else parts[0])
        for original, grad in self.layers.side_gradients():
            targets.append(original)
            grads.append(grad)
        if targets:
            torch.autograd.backward(targets, grads)


class _OrderedGradientSender:
    """Last stage: sends each micro-batch's input gradients upstream in the schedule's backward order.

    Autograd fires the gradient hooks as it reaches each micro-batch (in reverse order, since the loss is computed on
    the concatenation); a fixed order lets the receiver post its receives before anything arrives, and a gradient
    that arrives before its turn waits here.
    """

    def __init__(self, link: Link, order: list[int], sends: list[dist.Work], timeline: StepTimeline) -> None:
        self.link = link
        self.sends = sends
        self.timeline = timeline
        self.mark: Stamp | None = None  # where the backward of the next micro-batch to finish began
        self.inputs: dict[int, tuple[Tensor, ...]] = {}
        self.grads: dict[int, tuple[Tensor, ...]] = {}
        self.order = deque(order)

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
        while self.order and (force or self.order[0] in self.grads):
            m = self.order.popleft()
            grads = self.grads.pop(m, None)
            if grads is None:  # the loss did not reach this micro-batch: its gradient is zero
                grads = tuple(torch.zeros_like(t) for t in self._needing(m))
            start = self.timeline.now()
            self.sends.extend(self.link.send_tensors(grads))
            self.timeline.add(SEND, m, start)

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
