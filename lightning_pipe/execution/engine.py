"""Executes a stage's schedule: forwards and backwards of (chunk, micro-batch) pairs, with their sends and receives.

The engine knows nothing of Lightning or of the user's step: :mod:`lightning_pipe.execution.runtime` decides when the phases
run. A stage holds one model chunk, or several with virtual stages; its actions come from a schedule
(:mod:`lightning_pipe.schedules`), each naming a chunk and a micro-batch. Two ways to run them:

Every action runs through one entry, :meth:`PipelineEngine.execute`, and one table, one handler per kind of
action (``PipelineEngine._handlers``). A forward needs what the model's code called the chunk with: ``execute``
hands it to its caller as a value, a :class:`ChunkForward`, and goes on once the caller has answered it
(:meth:`ChunkForward.run`). Two callers answer differently:

* **Whole-batch steps** (GPipe, and every forward-only step): the model's code calls a chunk's blocks once with the
  whole batch. :meth:`PipelineEngine.forward_chunk` executes the chunk's forwards, answering each with that call's
  micro-batch; on the last chunk it returns the joined output, on whose leaves the user's loss lands.
  :meth:`PipelineEngine.backward_phase` executes the schedule's backward actions afterwards, from the gradients the
  next stage sends (or, on the last chunk, those the user's ``loss.backward()`` left on the leaves).
* **Per-micro-batch steps** (1F1B, interleaved, zero bubble): :class:`~lightning_pipe.execution.steps.MicroBatchStep`
  executes the whole schedule and answers each forward by running the user's step on that micro-batch, whose call
  of the chunk's blocks runs the forward; each backward of the last chunk starts from the loss it hands back
  (:attr:`ChunkForward.loss`).

Every chunk output that another chunk reads is cut from the graph: the next chunk's input is a leaf (received, or
handed over on the same stage), and the last chunk's output reaches the user's code as leaves. So each backward
runs one chunk on one micro-batch, from the gradient of its output to the gradients of its input and weights, and
may be split into the two (:mod:`lightning_pipe.execution.split_backward`). One exception, as in torch's runtime: in
a per-micro-batch step whose backward of the last chunk is neither split nor re-computed, the user's code gets that
chunk's output itself, and the micro-batch's loss back-propagates through the head and the chunk in one backward.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.graph import GradientEdge
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.checkpoint import checkpoint

from lightning_pipe.execution.batchnorm import DeferredBatchNorm
from lightning_pipe.execution.chunk_graph import (
    WHERE_INPUT,
    CallState,
    backward_into_user_graph,
    cut_output,
    grad_or_zeros,
    gradient_edges,
    input_leaf,
)
from lightning_pipe.execution.inboxes import ActivationInbox, GradientInbox, Key, PipelineMismatchError
from lightning_pipe.execution.p2p import ACTIVATION, SKIP, Header, Link, TensorMeta
from lightning_pipe.execution.random_streams import StageRandomStreams
from lightning_pipe.execution.recomputation import recompute_later, unchanged_running_stats
from lightning_pipe.execution.sharding import weights_in_graph
from lightning_pipe.execution.split_backward import WeightGradients, backward_input
from lightning_pipe.execution.call_order import ChainKey, ChunkCall
from lightning_pipe.execution.stage import StageBlocks
from lightning_pipe.execution.step_agreement import StepSignature
from lightning_pipe.partition import microbatch
from lightning_pipe.partition.microbatch import Activation
from lightning_pipe.schedules.actions import Action, ActionKind, PipelineSchedule, RecomputeMode
from lightning_pipe.trace.timeline import BACKWARD, FORWARD, SEND, WAIT, StepTimeline

__all__ = ["ChunkForward", "PipelineEngine", "PipelineMismatchError"]

_FORWARD_KINDS = ("recv", "forward", "send")
_SAME_PATH = (
    "; the step must take the same path on every stage (do not branch on random numbers or on per-process state"
    " before the pipelined call)."
)


@dataclass
class _MicroBatch:
    """One chunk's work on one micro-batch on this stage: what its backward needs, and what it leaves."""

    call: ChunkCall
    inputs: tuple[Tensor, ...]  # the chunk's inputs as autograd leaves (the backward stops there)
    # Where the outputs' gradients enter the chunk's graph (``None``: an output that needs none), aligned with
    # ``output_grads``. An output's values are not kept: backward needs them only where the graph saved them.
    outputs: tuple[GradientEdge | None, ...] = ()
    output_metas: tuple[TensorMeta, ...] = ()  # the shapes of the gradients the next stage sends back
    user_outputs: tuple[Tensor, ...] = ()  # last chunk: the leaves the user's code got; the loss's gradient lands there
    output_grads: tuple[Tensor, ...] | None = None
    loss: Tensor | None = None  # last chunk of a per-micro-batch step: the micro-batch's scaled loss
    recomputed: bool = False  # by torch.utils.checkpoint, in its backward (which then cannot be split)
    rerun: Callable[[], Any] | None = None  # a re-computed forward whose backward is split: see `recompute_later`
    weights: WeightGradients | None = None  # left by the input half of a split backward


@dataclass
class _Input:
    """A chunk's input on one micro-batch, as autograd leaves: the travelling value's tensors (``is_tuple``: a tuple
    of them), then the earlier blocks' outputs ``carried`` with it."""

    tensors: tuple[Tensor, ...]
    is_tuple: bool
    carried: tuple[ChainKey, ...] = ()


@dataclass
class _Output:
    """A chunk's output on its way to the next chunk: detached, with which tensors need a gradient. The travelling
    value (a tensor, or a tuple of them) comes first, then the earlier blocks' outputs ``carried`` with it."""

    tensors: tuple[Tensor, ...]
    requires_grad: tuple[bool, ...]
    is_tuple: bool
    carried: tuple[ChainKey, ...] = ()


class ChunkForward:
    """A forward of the schedule, handed by :meth:`PipelineEngine.execute` to its caller, who answers it with what the
    model's code called the chunk with (:meth:`run`), or not at all (the user's step returned before the chunk: the
    micro-batch is skipped); on the last chunk of a per-micro-batch step, the caller hands back the micro-batch's
    scaled loss (:attr:`loss`), where its backward starts."""

    __slots__ = ("action", "chunk", "micro_batch", "_engine", "ran", "loss")

    def __init__(self, action: Action, engine: PipelineEngine) -> None:
        self.action = action
        self.chunk, self.micro_batch = action.chunk, action.micro_batch
        self._engine = engine
        self.ran = False
        self.loss: Tensor | None = None

    def run(self, call: ChunkCall, own_input: Activation | None = None, part: int = 0, parts: int = 1) -> Activation | None:
        """The chunk on this micro-batch: its input ``own_input`` on the first chunk (else received, or handed over on
        this stage), the side arguments part ``part`` of ``parts`` of ``call``'s. Its output on the last chunk (as
        leaves), else ``None``."""
        self.ran = True
        engine = self._engine
        inputs = _input_of(engine._step, self.chunk, self.micro_batch, own_input)
        return engine._run_micro_batch(self.action, call, inputs, part, parts)


@dataclass
class _StepState:
    """What one step leaves between the engine's calls: the micro-batches in flight, messages, calls in progress."""

    num_micro_batches: int = 0
    actions: list[Action] = field(default_factory=list)  # this stage's schedule for the step
    next_action: int = 0  # the first action not executed yet
    split: set[Key] = field(default_factory=set)  # the pairs whose backward is split into input and weight halves
    micro_batches: dict[Key, _MicroBatch] = field(default_factory=dict)
    skipped: set[Key] = field(default_factory=set)  # per-micro-batch steps: pairs whose step returned before them
    outputs: dict[Key, _Output] = field(default_factory=dict)  # chunk outputs: to send, hand over, or received
    input_grads: dict[Key, tuple[Tensor, ...]] = field(default_factory=dict)  # to send to the chunk before
    calls: dict[int, CallState] = field(default_factory=dict)  # id(call) -> its micro-batches in this step
    inboxes: dict[int, ActivationInbox] = field(default_factory=dict)  # per stage sending activations here
    gradient_inboxes: dict[int, GradientInbox] = field(default_factory=dict)
    sends: _SendsInFlight = field(default_factory=lambda: _SendsInFlight())  # kept until they complete
    sent_metas: dict[int, tuple[TensorMeta, ...]] = field(default_factory=dict)  # per peer: the last activation's
    announced: set[int] = field(default_factory=set)  # the stages this step's signature was sent to

    def wait_sends(self, done_only: bool = False) -> None:
        """Wait for this step's sends to complete (``done_only``: release the completed ones, wait for none), each
        named if it fails."""
        if done_only:
            self.sends.release_completed()
        else:
            self.sends.wait_all()

    def signed(self, peer: int, signature: StepSignature | None) -> StepSignature | None:
        """The step's ``signature`` (see :mod:`lightning_pipe.execution.step_agreement`) in its first message to
        ``peer``, which compares it with its own before using the message; none in the others."""
        if signature is None or peer in self.announced:
            return None
        self.announced.add(peer)
        return signature


class _SendsInFlight:
    """A step's sends that have not completed, oldest first for each neighbour; their tensors are held until then.

    A neighbour takes the activations (or the gradients) sent to it in the order they were sent, so releasing the
    completed ones of each neighbour and kind from the oldest until the first still in flight costs a check or two
    per neighbour, however many sends a schedule keeps in flight.
    """

    def __init__(self) -> None:
        self._by_link: dict[tuple[int, str], deque[tuple[Link, list[dist.Work], str]]] = {}

    def append(self, send: tuple[Link, list[dist.Work], str]) -> None:
        link, _, what = send
        self._by_link.setdefault((id(link), what), deque()).append(send)

    def release_completed(self) -> None:
        for queue in self._by_link.values():
            while queue and all(work.is_completed() for work in queue[0][1]):
                link, works, what = queue.popleft()
                link.wait(works, what, sending=True)  # completed: raises only if the send failed

    def wait_all(self) -> None:
        for queue in self._by_link.values():
            while queue:
                link, works, what = queue.popleft()
                link.wait(works, what, sending=True)


class PipelineEngine:
    """Runs one stage's share of each step; one instance per process.

    ``links`` connects this stage to the stages it exchanges messages with (by stage index). ``random_streams``,
    given with more than one stage, runs each micro-batch's forward of each chunk on a random stream of its own.
    """

    def __init__(
        self,
        stage: StageBlocks,
        num_micro_batches: int,
        recompute: RecomputeMode,
        links: dict[int, Link],
        schedule: PipelineSchedule,
        virtual_stages: int = 1,
        timeline: StepTimeline | None = None,
        random_streams: StageRandomStreams | None = None,
        backward_done: Callable[[int], None] | None = None,
    ) -> None:
        self.stage = stage
        self.num_micro_batches = num_micro_batches
        self.recompute = recompute
        self.links = links
        self.schedule = schedule
        self.virtual_stages = virtual_stages
        self.random_streams = random_streams
        self._backward_done = backward_done  # FSDP hook: chunk k's backward of a micro-batch ended
        self.last_chunk = stage.num_chunks - 1
        self._owners = {k: schedule.owner(k, stage.num_stages) for k in range(stage.num_chunks)}
        self._step = _StepState()
        self._step_signature: StepSignature | None = None  # the step run now, as neighbours must: `_StepState.signed`
        self._batch_norms = {
            chunk: [m for i in chunk_range for m in stage.originals[i].modules() if isinstance(m, _BatchNorm)]
            for chunk, chunk_range in stage.chunk_ranges.items()
        }
        self._blocks = {chunk: [stage.originals[i] for i in chunk_range] for chunk, chunk_range in stage.chunk_ranges.items()}
        # Intervals of forward, backward, sends and waits, for the bubble metric and traces (off: no-op calls).
        self.timeline = timeline if timeline is not None else StepTimeline(torch.device("cpu"), enabled=False)
        # Every action but a forward (see `execute`) runs by this table: one handler per kind.
        self._handlers: dict[ActionKind, Callable[[Action], None]] = {
            "recv": self._receive_input,
            "send": self._send_activation,
            "recv_grad": self._receive_gradient,
            "backward": self._backward,
            "backward_input": self._backward,
            "backward_weight": self._backward_weights,
            "send_grad": self._send_gradient,
        }

    @property
    def holds_last_chunk(self) -> bool:
        """Whether the model's output, and so the loss, is computed on this stage."""
        return self.last_chunk in self.stage.chunk_ranges

    def owner(self, chunk: int) -> int:
        """The stage that holds ``chunk`` (asked for every message: known once)."""
        return self._owners[chunk]

    def _here(self, chunk: int) -> bool:
        return self.owner(chunk) == self.stage.stage_index

    def sign_step(self, signature: StepSignature | None) -> None:
        """The step about to run, as the neighbours must run it too (see lightning_pipe.execution.step_agreement);
        ``None`` for a call outside a step, which signs nothing."""
        self._step_signature = signature

    def begin_step(self) -> None:
        """Forget the previous step (its backward may have been skipped)."""
        self._step.wait_sends()
        self._step = _StepState()
        self.timeline.begin_step()
        if self.random_streams is not None:
            self.random_streams.begin_step()

    def _plan(self, num: int) -> None:
        """This step's actions for ``num`` micro-batches."""
        step = self._step
        step.num_micro_batches = num
        stage = self.stage
        step.actions = self.schedule.stage_actions(
            stage.stage_index, stage.num_stages, num, self.virtual_stages, self.recompute
        )
        step.split = {(a.chunk, a.micro_batch) for a in step.actions if a.kind == "backward_input"}

    # ---- whole-batch steps ---------------------------------------------------------------------------------------

    def forward_chunk(self, call: ChunkCall) -> Activation | None:
        """Run ``call``'s chunk on every micro-batch of the step; the joined output on the last chunk, else ``None``.

        Training, the forwards come from this step's schedule (GPipe: all before any backward); without gradients,
        micro-batches 0..M-1 of the chunk, received and sent on as they come.
        """
        k, step, grad = call.chunk, self._step, torch.is_grad_enabled()
        parts = microbatch.split(call.stage_input, self.num_micro_batches) if k == 0 else []
        num = len(parts) if k == 0 else self._micro_batches_sent_to(k)
        if not step.actions and grad:
            self._plan(num)
        step.num_micro_batches = num
        if grad:
            actions = [a for a in step.actions[step.next_action:] if a.chunk == k and a.kind in _FORWARD_KINDS]
            step.next_action = step.actions.index(actions[-1]) + 1
        else:
            actions = self._forward_only_actions(k, num)
        outputs: dict[int, Activation | None] = {}
        for forward in self.execute(actions):  # each micro-batch of the call the model's code made
            m = forward.micro_batch
            outputs[m] = forward.run(call, parts[m] if k == 0 else None, m, num)
        # Training, the forward phase is followed by waits for the next stage (its gradients, the step's outcome):
        # sent activations are held until the next stage has them, and no longer.
        self._step.wait_sends(done_only=not grad)
        if k != self.last_chunk:
            return None
        return microbatch.join([outputs[m] for m in range(num)], alias=grad)

    def _micro_batches_sent_to(self, k: int) -> int:
        """The count of micro-batches chunk ``k`` runs on in this step: those of chunk ``k - 1``, run here or sent."""
        if self._here(k - 1):
            return self._step.num_micro_batches
        header = self._inbox(k - 1).first_header()
        if header.kind == SKIP:
            raise PipelineMismatchError(
                f"stage {self.stage.stage_index} reached model chunk {k} in this step, but stage"
                f" {self.owner(k - 1)}'s step returned before running chunk {k - 1}" + _SAME_PATH
            )
        return header.num_micro_batches

    def _forward_only_actions(self, k: int, num: int) -> list[Action]:
        """Chunk ``k``'s forwards without a backward to follow: each micro-batch received, run and sent on in turn."""
        actions: list[Action] = []
        for m in range(num):
            actions += [Action("recv", m, k)] if k > 0 and not self._here(k - 1) else []
            actions.append(Action("forward", m, k))
            actions += [Action("send", m, k)] if k < self.last_chunk and not self._here(k + 1) else []
        return actions

    def backward_phase(self) -> None:
        """After the forwards of a whole-batch step: the rest of the schedule (receive gradients, back-propagate,
        send the input gradients), from the gradients the user's ``loss.backward()`` left on the last chunk's
        output leaves, or those the next stage sends."""
        step = self._step
        for forward in self.execute(step.actions[step.next_action:]):
            raise AssertionError(f"{forward.action} after a whole-batch step's forwards")
        step.next_action = len(step.actions)
        self.end_step()

    # ---- per-micro-batch steps -----------------------------------------------------------------------------------

    def plan(self, num: int) -> list[Action]:
        """This step's actions for ``num`` micro-batches (a per-micro-batch step executes them all at once)."""
        self._plan(num)
        return self._step.actions

    def _skip(self, k: int, m: int) -> None:
        """The user's step on micro-batch ``m`` returned before reaching chunk ``k``: the micro-batch is skipped on
        every stage (no backward, no gradient), as one device skips a step that returns ``None``."""
        if k > 0:
            raise PipelineMismatchError(
                f"stage {self.stage.stage_index}'s step on micro-batch {m} returned before reaching model chunk {k},"
                f" but stage {self.owner(k - 1)} ran chunk {k - 1} on it" + _SAME_PATH
            )
        self._step.skipped.add((k, m))
        self._pass_skip(k, m)

    def _pass_skip(self, k: int, m: int) -> None:
        """(chunk ``k``, micro-batch ``m``) is skipped: so is the next chunk's, whose stage learns it instead of an
        activation."""
        step = self._step
        if k == self.last_chunk:
            return
        if self._here(k + 1):
            step.skipped.add((k + 1, m))
            return
        peer = self.owner(k + 1)
        link = self.links[peer]
        # The receiver posted no guess of the next message's shapes after this one (see ActivationInbox): none is
        # expected.
        header = Header(SKIP, m, step.num_micro_batches, chunk=k + 1, step=self._step.signed(peer, self._step_signature))
        works = link.send_skip(header, step.sent_metas.pop(peer, None))
        step.sends.append((link, works, "the activations"))

    # ---- skipped whole-batch steps ----------------------------------------------------------------------------

    def skip_step(self) -> None:
        """A whole-batch step that returned before reaching any of this stage's chunks: expect the same of the
        stages before each chunk, and tell the stages after it."""
        for k in sorted(self.stage.chunk_ranges):
            if k > 0 and not self._here(k - 1):
                header = self._inbox(k - 1).first_header()
                if header.kind != SKIP:
                    raise PipelineMismatchError(
                        f"stage {self.owner(k - 1)} ran chunk {k - 1} in this step but stage"
                        f" {self.stage.stage_index}'s step returned before reaching chunk {k}" + _SAME_PATH
                    )
            if k < self.last_chunk and not self._here(k + 1):
                peer = self.owner(k + 1)
                link, header = self.links[peer], Header(SKIP, chunk=k + 1, step=self._step.signed(peer, self._step_signature))
                self._step.sends.append((link, [link.send_header(header)], "the activations"))
        self._step.wait_sends()

    # ---- executing actions ---------------------------------------------------------------------------------------

    def execute(self, actions: list[Action]) -> Iterator[ChunkForward]:
        """Run ``actions`` in order, each by its kind's handler; each forward is handed to the caller (see
        :class:`ChunkForward`), and the next action runs once the caller asks for it. A skipped micro-batch's forward
        only passes the skip on, and nothing else runs for it."""
        step = self._step
        skipped, handlers = step.skipped, self._handlers
        for action in actions:
            key = (action.chunk, action.micro_batch)
            if key in skipped:
                if action.kind == "forward":
                    self._pass_skip(*key)
            elif action.kind == "forward":
                forward = ChunkForward(action, self)
                yield forward
                if not forward.ran:
                    self._skip(*key)  # the user's step returned before reaching the chunk's blocks
                elif forward.loss is not None:
                    step.micro_batches[key].loss = forward.loss
            else:
                handlers[action.kind](action)
            step.sends.release_completed()

    def _receive_input(self, action: Action) -> None:
        """Receive micro-batch ``m``'s input of chunk ``k`` from the stage of chunk ``k - 1`` (or that it skipped it)."""
        k, m = action.chunk, action.micro_batch
        start = self.timeline.now()
        header, tensors = self._inbox(k - 1).take(k, m)
        self.timeline.add(WAIT, m, start)
        if header.kind == SKIP:
            self._step.skipped.add((k, m))
        else:
            needs = tuple(t.requires_grad for t in header.tensors)
            self._step.outputs[(k - 1, m)] = _Output(tensors, needs, header.is_tuple, header.carried)

    def _inbox(self, sending_chunk: int) -> ActivationInbox:
        """The activations from the stage holding ``sending_chunk``, in this step's order."""
        peer = self.owner(sending_chunk)
        step = self._step
        if peer not in step.inboxes:
            step.inboxes[peer] = ActivationInbox(self.links[peer], partial(self._expected_from, peer), self._step_signature)
        return step.inboxes[peer]

    def _expected_from(self, peer: int) -> list[Key]:
        """The (chunk, micro-batch) pairs this step receives from ``peer``, in order (asked once the step's count
        of micro-batches is known)."""
        step = self._step
        if step.actions:
            return [(a.chunk, a.micro_batch) for a in step.actions if a.kind == "recv" and self.owner(a.chunk - 1) == peer]
        return [  # forward-only: the chunks in order, every micro-batch of each
            (k, m) for k in sorted(self.stage.chunk_ranges) if k > 0 and self.owner(k - 1) == peer
            for m in range(step.num_micro_batches)
        ]

    def _run_micro_batch(self, action: Action, call: ChunkCall, taken: _Input, part: int, parts: int) -> Activation | None:
        """Chunk ``action.chunk`` on micro-batch ``action.micro_batch`` (part ``part`` of ``parts`` of ``call``'s
        batch), re-computed in backward when the action says so. Its output is kept to send or to hand to the next
        chunk; on the last chunk it is returned, cut from the graph (see :func:`cut_output`) unless the micro-batch's
        loss, computed from it, will back-propagate through the chunk in one backward (a per-micro-batch step whose
        backward of it is neither split nor re-computed)."""
        k, m = action.chunk, action.micro_batch
        inputs = taken.tensors
        run = partial(self.stage.run_micro_batch, call, part, parts, taken.is_tuple, taken.carried)
        if self.random_streams is not None:  # inside what re-computation re-runs: its dropout draws the same mask
            run = self.random_streams.seeded_run(run, m, k)
        start = self.timeline.now()
        step = self._step
        grad = torch.is_grad_enabled()
        # A re-computed forward whose backward is split runs now without a graph, and again right before its input
        # half (see `recompute_later`): its outputs that may need a gradient are all the floating-point ones.
        later = grad and action.recompute and (k, m) in step.split
        micro_batch = _MicroBatch(call, inputs, recomputed=grad and action.recompute and not later)
        try:
            if later:
                (out, carried), micro_batch.rerun = recompute_later(run, inputs, self._recomputing(m))
            elif grad and action.recompute:
                context = partial(self._recomputation_contexts, m)
                out, carried = checkpoint(run, *inputs, use_reentrant=False, context_fn=context)
            else:
                out, carried = run(*inputs)
        except Exception as error:  # the user's error, unchanged, with where in the pipeline it happened
            error.add_note(_where_it_failed(self, error, inputs, call, m))
            raise
        self.timeline.add(FORWARD, m, start)
        result = None
        if k == self.last_chunk:
            if grad and self.schedule.per_micro_batch and not action.recompute and (k, m) not in step.split:
                result = out  # one backward, as torch's: the micro-batch's loss back-propagates through the chunk
            else:
                result, originals, micro_batch.user_outputs = cut_output(out, grad, every_float=later)
                micro_batch.outputs = gradient_edges(originals)
        else:
            step.outputs[(k, m)] = _output_to_pass_on(micro_batch, out, carried, later, k, m)
        if grad:
            step.micro_batches[(k, m)] = micro_batch
            step.calls.setdefault(id(call), CallState(call)).forwarded[m] = inputs
        if m == step.num_micro_batches - 1:
            for batch_norm in self._batch_norms[k]:
                if isinstance(batch_norm, DeferredBatchNorm):
                    batch_norm.commit()  # the mini-batch is complete: update the running statistics once
        return result

    def _send_activation(self, action: Action) -> None:
        """Send chunk ``k``'s output of micro-batch ``m`` to the stage holding chunk ``k + 1``."""
        k, m = action.chunk, action.micro_batch
        step = self._step
        out = step.outputs.pop((k, m))
        outputs = out.tensors
        metas = tuple(TensorMeta(tuple(t.shape), t.dtype, needs) for t, needs in zip(outputs, out.requires_grad))
        peer = self.owner(k + 1)
        start = self.timeline.now()
        header = Header(ACTIVATION, m, step.num_micro_batches, metas, out.is_tuple, k + 1, out.carried, self._step.signed(peer, self._step_signature))
        link = self.links[peer]
        # The receiver posted this message's receive with the previous message's shapes (see ActivationInbox).
        works = link.send_activation(header, outputs, step.sent_metas.get(peer))
        step.sent_metas[peer] = metas
        step.sends.append((link, works, "the activations"))
        self.timeline.add(SEND, m, start)

    def _receive_gradient(self, action: Action) -> None:
        """Receive the gradients of chunk ``k``'s output on micro-batch ``m`` from the stage holding chunk ``k + 1``."""
        k, m = action.chunk, action.micro_batch
        start = self.timeline.now()
        peer = self.owner(k + 1)
        step = self._step
        if peer not in step.gradient_inboxes:
            expected = [
                (a.chunk, a.micro_batch) for a in step.actions
                if a.kind == "recv_grad" and self.owner(a.chunk + 1) == peer
            ]
            step.gradient_inboxes[peer] = GradientInbox(self.links[peer], expected)
        step.micro_batches[(k, m)].output_grads = step.gradient_inboxes[peer].take(k, m, step.micro_batches)
        self.timeline.add(WAIT, m, start)

    def _backward(self, action: Action) -> None:
        """Chunk ``k``'s backward on micro-batch ``m``: its input gradients (kept to send, or for the chunk before on
        this stage), and its weight gradients unless the action is the input half of a split backward."""
        k, m, split = action.chunk, action.micro_batch, action.kind == "backward_input"
        step = self._step
        micro_batch = step.micro_batches[(k, m)]
        start = self.timeline.now()
        if k == self.last_chunk:
            if micro_batch.loss is not None:
                micro_batch.loss.backward()  # through the model's head to the chunk's cut output, or through the chunk
                micro_batch.loss = None
            micro_batch.output_grads = tuple(grad_or_zeros(t) for t in micro_batch.user_outputs)
        assert micro_batch.output_grads is not None  # received, or handed over by the next chunk on this stage
        if micro_batch.rerun is not None:  # the graph, for both halves of the backward
            self._rerun_forward(micro_batch, k)
        pairs = [(edge, g) for edge, g in zip(micro_batch.outputs, micro_batch.output_grads) if edge is not None]
        edges, grads = [edge for edge, _ in pairs], [g for _, g in pairs]
        needing = [t for t in micro_batch.inputs if t.requires_grad]
        # Not split: a forward re-computed by torch.utils.checkpoint (re-computed again by each half), and compiled
        # blocks (their backward computes every gradient at once, in each half).
        if split and edges and not micro_batch.recomputed and not self.stage.compiled_calls:
            weights = [*weights_in_graph(self._blocks[k]), *(leaf for _, leaf in micro_batch.call.leaves.values())]
            input_grads, micro_batch.weights = backward_input(edges, grads, needing, weights)
            for leaf, input_grad in zip(needing, input_grads):
                leaf.grad = input_grad
        elif edges:
            torch.autograd.backward(edges, grads)
        micro_batch.output_grads = None
        self.timeline.add(BACKWARD, m, start)
        if k > 0:
            self._pass_input_gradients(k, m, tuple(grad_or_zeros(t) for t in needing))
        if not split:
            self._done(k, m)

    def _rerun_forward(self, micro_batch: _MicroBatch, k: int) -> None:
        """A forward re-computed for a split backward: run again with its graph, where both halves start."""
        assert micro_batch.rerun is not None
        (out, carried), micro_batch.rerun = micro_batch.rerun(), None
        if k == self.last_chunk:
            micro_batch.outputs = gradient_edges(cut_output(out, True, every_float=True)[1])
        else:
            tensors = microbatch.as_tensors(micro_batch.call.travelling(out), "") + tuple(carried.values())
            micro_batch.outputs = gradient_edges(t for t in tensors if t.is_floating_point())

    def _pass_input_gradients(self, k: int, m: int, gradients: tuple[Tensor, ...]) -> None:
        """Chunk ``k``'s input gradients on micro-batch ``m``: handed to chunk ``k - 1`` on this stage, else kept to
        send."""
        step = self._step
        if self._here(k - 1):
            step.micro_batches[(k - 1, m)].output_grads = gradients
        else:
            step.input_grads[(k, m)] = gradients

    def _backward_weights(self, action: Action) -> None:
        """The weight half of a split backward: the gradients of chunk ``k``'s weights on micro-batch ``m``."""
        k, m = action.chunk, action.micro_batch
        micro_batch = self._step.micro_batches[(k, m)]
        if micro_batch.weights is not None:
            start = self.timeline.now()
            micro_batch.weights.compute()
            micro_batch.weights = None
            self.timeline.add(BACKWARD, m, start)
        self._done(k, m)

    def _send_gradient(self, action: Action) -> None:
        """Send the gradients of chunk ``k``'s input on micro-batch ``m`` to the stage holding chunk ``k - 1``."""
        start = self.timeline.now()
        link = self.links[self.owner(action.chunk - 1)]
        works = link.send_gradients(self._step.input_grads.pop((action.chunk, action.micro_batch)))
        self._step.sends.append((link, works, "the gradients"))
        self.timeline.add(SEND, action.micro_batch, start)

    def _done(self, k: int, m: int) -> None:
        """(chunk, micro-batch) is back-propagated; once every micro-batch of its call is, the gradients that stopped
        at the call's leaves go on into the model's own code."""
        step = self._step
        call = step.micro_batches.pop((k, m)).call
        if self._backward_done is not None:
            self._backward_done(k)
        state = step.calls[id(call)]
        state.back_propagated += 1
        if state.back_propagated == len(state.forwarded):
            del step.calls[id(call)]
            backward_into_user_graph(state)

    def end_step(self) -> None:
        self._step.wait_sends()
        self._step = _StepState()

    # ---- errors and re-computation -------------------------------------------------------------------------------

    def _recomputation_contexts(
        self, m: int
    ) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """The forward runs normally; its re-computation in backward must not update BatchNorm statistics again,
        and is recorded on the timeline."""
        return contextlib.nullcontext(), self._recomputing(m)

    @contextlib.contextmanager
    def _recomputing(self, m: int) -> Iterator[None]:
        batch_norms = [bn for chunk_norms in self._batch_norms.values() for bn in chunk_norms]
        with self.timeline.recomputing(m), unchanged_running_stats(batch_norms):
            yield


def _output_to_pass_on(
    micro_batch: _MicroBatch, out: Any, carried: dict[ChainKey, Tensor], later: bool, k: int, m: int
) -> _Output:
    """A chunk's output that is not the model's, detached for the next chunk; ``micro_batch`` keeps where the
    gradients of those that need one enter its graph, and their shapes."""
    out = micro_batch.call.travelling(out)
    outputs = microbatch.as_tensors(out, f"the output of model chunk {k} for micro-batch {m}")
    if micro_batch.inputs:
        microbatch.check_batch_kept(micro_batch.inputs, outputs, k, m)
    outputs += tuple(carried.values())
    needs = tuple(t.requires_grad or (later and t.is_floating_point()) for t in outputs)
    micro_batch.outputs = gradient_edges(t for t, needed in zip(outputs, needs) if needed)
    micro_batch.output_metas = tuple(
        TensorMeta(tuple(t.shape), t.dtype, False) for t, needed in zip(outputs, needs) if needed
    )
    return _Output(tuple(t.detach() for t in outputs), needs, isinstance(out, tuple), tuple(carried))


def _where_it_failed(
    engine: PipelineEngine, error: Exception, inputs: tuple[Tensor, ...], call: ChunkCall, m: int
) -> str:
    """A note for an error raised by a chunk's blocks: the stage, its blocks, the micro-batch, and, for a dtype
    error on a received input, the stage that sent that dtype."""
    stage = engine.stage
    chunk_range = stage.chunk_ranges[call.chunk]
    span = f"{chunk_range.start}..{chunk_range.stop - 1}"
    chunk = f", model chunk {call.chunk}" if stage.num_chunks != stage.num_stages else ""
    num = engine._step.num_micro_batches
    note = f"raised by pipeline stage {stage.stage_index}{chunk} (blocks {span}) on micro-batch {m} of {num}"
    if stage.region.container is None:
        note += f" ({call.describe(stage.region.names)})"
    received = sorted({str(t.dtype) for t in inputs if t.is_floating_point()})
    own = sorted({str(p.dtype) for b in engine._blocks[call.chunk] for p in b.parameters() if p.is_floating_point()})
    if call.chunk > 0 and ("dtype" in str(error) or "scalar type" in str(error)) and received != own:
        note += (
            f"; it received {', '.join(received)} from stage {engine.owner(call.chunk - 1)} but its parameters are"
            f" {', '.join(own)}: give every stage the same dtype (convert the whole model, e.g. model.double(),"
            " or set the Trainer's precision)"
        )
    return note


def _input_of(step: _StepState, k: int, m: int, own: Activation | None) -> _Input:
    """In ``step``, micro-batch ``m``'s input of chunk ``k``, as leaves: ``own`` for the first chunk, the output of
    chunk ``k - 1`` when this stage holds it, else received."""
    grad = torch.is_grad_enabled()
    if k == 0:
        assert own is not None
        leaves = tuple(input_leaf(t, grad and t.requires_grad) for t in microbatch.as_tensors(own, WHERE_INPUT))
        return _Input(leaves, isinstance(own, tuple))
    out = step.outputs.pop((k - 1, m))  # handed over by chunk k - 1 on this stage, or received
    leaves = tuple(input_leaf(t, grad and needs) for t, needs in zip(out.tensors, out.requires_grad))
    return _Input(leaves, out.is_tuple, out.carried)
