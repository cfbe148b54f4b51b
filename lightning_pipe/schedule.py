"""Pipeline schedules: the ordered actions each stage performs in one training step, which the engine executes.

The pipelined blocks are cut into ``S·v`` contiguous *chunks* (``S`` stages, ``v`` virtual stages: chunks per
stage); chunk 0 runs first, chunk ``S·v - 1`` last and feeds the loss. A placement puts each chunk on a stage:
``"loop"``, chunk ``k`` on stage ``k % S``; ``"v"`` (``v = 2``), down the stages and back up, so that the first
stage holds the first and the last chunk. A schedule lists, for each stage, its forwards and backwards of (chunk,
micro-batch) pairs and the messages between them; the engine executes each list strictly in order.

GPipe with 3 stages and 4 micro-batches, at the ticks :func:`clock_cycles` finds when a forward (``F``) takes one
tick and a backward (``B``, input and weight gradients) two (``.`` is the idle bubble; :func:`render_timeline`
draws it from the actions; ``render_timeline(3, 4)``)::

    tick     0  1  2  3  4  5  6  7  8  9  10 11 12 13 14 15 16 17
    stage 0  F0 F1 F2 F3 .  .  .  .  .  .  B3 -- B2 -- B1 -- B0 --
    stage 1  .  F0 F1 F2 F3 .  .  .  B3 -- B2 -- B1 -- B0 -- .  .
    stage 2  .  .  F0 F1 F2 F3 B3 -- B2 -- B1 -- B0 -- .  .  .  .

GPipe runs every forward before the first backward: its loss is computed on the joined output of all micro-batches
(the user's ``training_step`` sees the whole mini-batch). The other schedules (1F1B, interleaved 1F1B, zero bubble,
ZB-V) interleave forwards and backwards and need a loss per micro-batch (``per_micro_batch``). docs/schedules.md
compares them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal, NamedTuple, get_args

# recv: wait for a micro-batch's activations from the stage holding the previous chunk; send: pass a chunk's output
# to the stage holding the next one; recv_grad / send_grad: the same for gradients, in the other direction. forward
# and backward run one chunk's layers; backward_input computes only the gradient of the chunk's input (what the
# previous chunk waits for), backward_weight later the weights' gradients (what nobody waits for).
ActionKind = Literal[
    "recv", "forward", "send", "recv_grad", "backward", "backward_input", "backward_weight", "send_grad"
]
Placement = Literal["loop", "v"]
RecomputeMode = Literal["always", "except_last", "never"]
COMPUTE_KINDS: tuple[ActionKind, ...] = ("forward", "backward", "backward_input", "backward_weight")
# What computes a chunk's input gradient: what its send_grad, and the backward of the chunk before, wait for.
INPUT_GRADIENT_KINDS: tuple[ActionKind, ...] = ("backward", "backward_input")


@dataclass(frozen=True)
class Action:
    """One unit of work of a stage: ``kind`` on micro-batch ``micro_batch`` of model chunk ``chunk``."""

    kind: ActionKind
    micro_batch: int
    chunk: int  # the model chunk, 0..S·v-1 (on a stage holding it)
    recompute: bool = False  # forward only: keep only the inputs and run the forward again inside the backward

    def __str__(self) -> str:
        flag = ", recomputed" if self.recompute else ""
        return f"{self.kind}(chunk {self.chunk}, micro-batch {self.micro_batch}{flag})"


# (stage, num_stages, num_micro_batches, virtual_stages) -> that stage's actions, in the order it runs them.
StageActions = Callable[[int, int, int, int], list[Action]]


def owner(chunk: int, num_stages: int, placement: Placement = "loop") -> int:
    """The stage that holds ``chunk``: ``chunk % S`` in a loop; down the stages and back up in a V."""
    if placement == "v":
        return chunk if chunk < num_stages else 2 * num_stages - 1 - chunk
    return chunk % num_stages


def stage_chunks(stage: int, num_stages: int, virtual_stages: int, placement: Placement = "loop") -> list[int]:
    """The chunks ``stage`` holds, in model order."""
    return [k for k in range(num_stages * virtual_stages) if owner(k, num_stages, placement) == stage]


@dataclass(frozen=True)
class PipelineSchedule:
    """A schedule: the function that lists each stage's actions, and what the engine must know to run them.

    ``per_micro_batch``: the loss is computed per micro-batch, so a micro-batch's backward may start right after
    its last forward (every built-in schedule but GPipe, whose loss is computed on the whole mini-batch).
    ``virtual_stages`` is the default number of chunks per stage, ``min_virtual_stages`` and ``max_virtual_stages``
    (``None``: no limit) the allowed ones. ``bubble_formula(S, M, v)`` is the idle share of a step that the schedule
    is designed for (``None``: the simulated one, :func:`clock_cycles`).
    """

    name: str
    actions: StageActions = field(repr=False)
    per_micro_batch: bool
    placement: Placement = "loop"
    virtual_stages: int = 1
    min_virtual_stages: int = 1
    max_virtual_stages: int | None = 1
    bubble_formula: Callable[[int, int, int], float] | None = field(default=None, repr=False)

    def owner(self, chunk: int, num_stages: int) -> int:
        """The stage holding ``chunk``."""
        return owner(chunk, num_stages, self.placement)

    def chunks(self, stage: int, num_stages: int, virtual_stages: int) -> list[int]:
        """The chunks ``stage`` holds, in model order."""
        return stage_chunks(stage, num_stages, virtual_stages, self.placement)

    def neighbours(self, stage: int, num_stages: int, virtual_stages: int) -> list[int]:
        """The other stages that ``stage`` exchanges activations or gradients with: those holding a chunk next to
        one of its own."""
        last = num_stages * virtual_stages - 1
        return sorted({
            self.owner(k + step, num_stages) for k in self.chunks(stage, num_stages, virtual_stages)
            for step in (-1, 1) if 0 <= k + step <= last
        } - {stage})

    def loss_stage(self, num_stages: int, virtual_stages: int) -> int:
        """The stage holding the model's last chunk, which computes the loss."""
        return self.owner(num_stages * virtual_stages - 1, num_stages)

    def stage_actions(
        self,
        stage: int,
        num_stages: int,
        num_micro_batches: int,
        virtual_stages: int,
        recompute: RecomputeMode = "never",
    ) -> list[Action]:
        """``stage``'s actions with the re-computation flags of ``recompute`` (the public ``checkpoint`` option)."""
        return with_recompute(self.actions(stage, num_stages, num_micro_batches, virtual_stages), recompute)

    def ideal_bubble(self, num_stages: int, num_micro_batches: int, virtual_stages: int) -> float:
        """The idle share of a step with equal chunks, forward, input gradient and weight gradient one tick each."""
        if self.bubble_formula is not None:
            return self.bubble_formula(num_stages, num_micro_batches, virtual_stages)
        return clock_cycles(num_stages, num_micro_batches, self, virtual_stages).bubble_fraction

    def checked_virtual_stages(self, virtual_stages: object, key: str = "") -> int:
        """``virtual_stages``, or the default for ``None``; a ``ValueError`` naming the setting when this schedule
        cannot run that many chunks per stage. ``key`` prefixes the setting's name (``"strategy."`` under Hydra)."""
        if virtual_stages is None:
            return self.virtual_stages
        low, high = self.min_virtual_stages, self.max_virtual_stages
        if (
            isinstance(virtual_stages, bool)
            or not isinstance(virtual_stages, int)
            or virtual_stages < low
            or (high is not None and virtual_stages > high)
        ):
            allowed = f"exactly {low}" if low == high else f"{low} or more" if high is None else f"{low} to {high}"
            fix = f"leave {key}virtual_stages unset (the default is {self.virtual_stages})"
            if high == 1:
                fix += f", or use {key}schedule='interleaved_1f1b' for several chunks per stage"
            raise ValueError(
                f"{key}virtual_stages={virtual_stages!r} is invalid for {key}schedule={self.name!r}, which runs"
                f" {allowed} model {'chunk' if high == 1 else 'chunks'} per stage; {fix}."
            )
        return virtual_stages


def with_recompute(actions: list[Action], mode: RecomputeMode) -> list[Action]:
    """``actions`` with each forward's ``recompute`` flag set by the re-computation ``mode``: ``"always"``;
    ``"never"``; ``"except_last"``, every forward except those whose stage's next compute action is their own
    backward (their activations are freed soonest anyway): in GPipe the last micro-batch, in 1F1B every forward
    on the last stage."""
    if mode == "never":
        return actions
    kept: set[tuple[int, int]] = set()
    if mode == "except_last":
        compute = [a for a in actions if a.kind in COMPUTE_KINDS]
        kept = {
            (a.chunk, a.micro_batch)
            for a, after in zip(compute, compute[1:])
            if a.kind == "forward" and after.kind in INPUT_GRADIENT_KINDS
            and (after.chunk, after.micro_batch) == (a.chunk, a.micro_batch)
        }
    return [
        replace(a, recompute=True) if a.kind == "forward" and (a.chunk, a.micro_batch) not in kept else a
        for a in actions
    ]


def _with_messages(
    compute: list[Action], stage: int, num_stages: int, virtual_stages: int, placement: Placement
) -> list[Action]:
    """``compute`` (forwards and backwards) with the messages it needs: a receive right before a forward whose
    input comes from another stage, a send right after it when the next chunk is elsewhere; the same for gradients
    around each input-gradient backward. The messages then follow the compute order, so two stages agree on their
    order whenever they agree on the order of the chunks' forwards and backwards."""
    last = num_stages * virtual_stages - 1
    elsewhere = lambda chunk: owner(chunk, num_stages, placement) != stage  # noqa: E731
    listed: list[Action] = []
    for action in compute:
        k, m = action.chunk, action.micro_batch
        if action.kind == "forward":
            listed += [Action("recv", m, k)] if k > 0 and elsewhere(k - 1) else []
            listed.append(action)
            listed += [Action("send", m, k)] if k < last and elsewhere(k + 1) else []
        elif action.kind in INPUT_GRADIENT_KINDS:
            listed += [Action("recv_grad", m, k)] if k < last and elsewhere(k + 1) else []
            listed.append(action)
            listed += [Action("send_grad", m, k)] if k > 0 and elsewhere(k - 1) else []
        else:
            listed.append(action)
    return listed


# ---- the schedules ---------------------------------------------------------------------------------------------


def gpipe(
    stage: int, num_stages: int, num_micro_batches: int, virtual_stages: int = 1, *, split_backward: bool = False
) -> list[Action]:
    """GPipe: forwards of micro-batches 0..M-1, then backwards of M-1..0 (the order in which autograd reaches them
    from a loss on the joined output). One chunk per stage.

    ``split_backward`` defers each micro-batch's weight gradients: the stage computes the input gradient (``I``),
    sends it, and only then the weight gradients (``W``), so the stage before starts sooner and the drain bubble
    shrinks from ``(S-1)·(I+W)`` to ``(S-1)·I`` (``render_timeline(3, 4, gpipe_schedule(split_backward=True))``)::

        tick     0  1  2  3  4  5  6  7  8  9  10 11 12 13 14 15
        stage 0  F0 F1 F2 F3 .  .  .  .  I3 W3 I2 W2 I1 W1 I0 W0
        stage 1  .  F0 F1 F2 F3 .  .  I3 W3 I2 W2 I1 W1 I0 W0 .
        stage 2  .  .  F0 F1 F2 F3 I3 W3 I2 W2 I1 W1 I0 W0 .  .
    """
    backward = [Action("backward_input", 0, stage), Action("backward_weight", 0, stage)] if split_backward else [
        Action("backward", 0, stage)
    ]
    compute = [Action("forward", m, stage) for m in range(num_micro_batches)]
    compute += [replace(a, micro_batch=m) for m in reversed(range(num_micro_batches)) for a in backward]
    return _with_messages(compute, stage, num_stages, 1, "loop")


def gpipe_schedule(split_backward: bool = False) -> PipelineSchedule:
    """GPipe as a :class:`PipelineSchedule`, its weight gradients deferred with ``split_backward``."""
    actions: StageActions = (lambda s, n, m, v: gpipe(s, n, m, v, split_backward=True)) if split_backward else gpipe
    formula = _drain_of_input_gradients_bubble if split_backward else _fill_and_drain_bubble
    return PipelineSchedule("gpipe", actions, per_micro_batch=False, bubble_formula=formula)


def one_f_one_b(stage: int, num_stages: int, num_micro_batches: int, virtual_stages: int = 1) -> list[Action]:
    """1F1B (PipeDream-Flush, Megatron's default): ``S - stage - 1`` forwards to fill the pipeline, then one forward
    and one backward in turn, then the remaining backwards. GPipe's bubble, but a stage holds at most ``S - stage``
    micro-batches' activations instead of ``M``. One chunk per stage (``render_timeline(4, 8, "1f1b")``)::

        tick     0  1  2  3  4  5  6  7  8  9  10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31 32
        stage 0  F0 F1 F2 F3 .  .  .  .  .  .  B0 -- F4 B1 -- F5 B2 -- F6 B3 -- F7 B4 -- .  B5 -- .  B6 -- .  B7 --
        stage 1  .  F0 F1 F2 .  .  .  .  B0 -- F3 B1 -- F4 B2 -- F5 B3 -- F6 B4 -- F7 B5 -- .  B6 -- .  B7 -- .  .
        stage 2  .  .  F0 F1 .  .  B0 -- F2 B1 -- F3 B2 -- F4 B3 -- F5 B4 -- F6 B5 -- F7 B6 -- .  B7 -- .  .  .  .
        stage 3  .  .  .  F0 B0 -- F1 B1 -- F2 B2 -- F3 B3 -- F4 B4 -- F5 B5 -- F6 B6 -- F7 B7 -- .  .  .  .  .  .
    """
    warm_up = min(num_stages - stage - 1, num_micro_batches)
    forward = [Action("forward", m, stage) for m in range(num_micro_batches)]
    backward = [Action("backward", m, stage) for m in range(num_micro_batches)]
    return _with_messages(_one_forward_one_backward(forward, backward, warm_up), stage, num_stages, 1, "loop")


def _one_forward_one_backward(forwards: list[Action], backwards: list[Action], warm_up: int) -> list[Action]:
    """``warm_up`` forwards, then the next forward and the next backward in turn, then the remaining backwards."""
    steady = [a for pair in zip(forwards[warm_up:], backwards) for a in pair]
    return forwards[:warm_up] + steady + backwards[len(forwards) - warm_up :]


def interleaved_one_f_one_b(stage: int, num_stages: int, num_micro_batches: int, virtual_stages: int) -> list[Action]:
    """Interleaved 1F1B (Narayanan et al., Megatron-LM): ``v`` chunks per stage in a loop, 1F1B over (chunk,
    micro-batch) pairs. The micro-batches go in rounds: each round's forwards run chunk by chunk, the backwards in
    reverse chunk order. The pipeline fills ``v`` times faster, so the bubble drops to about ``(S-1)/(v·M+S-1)``.

    Megatron and torch's ``ScheduleInterleaved1F1B`` use rounds of exactly ``S`` micro-batches, which needs ``M``
    to divide evenly. Here the rounds are as even as possible and at least ``S`` long (``M // S`` rounds; all ``M``
    in one when ``M < S``), so any ``M`` runs: a round at least ``S`` long keeps the first stage busy until the
    round's first micro-batch comes back around the loop. The warm-up covers the first round's chunks but the
    last, plus two forwards for every stage further down: ``(v-1)·R + 2·(S-1-stage)``. (Rounds of exactly ``S``
    and a shorter last one would idle the first stage at every chunk of the short round, and deadlock at 4 stages,
    5 micro-batches and 3 chunks per stage.) ``render_timeline(2, 3, "interleaved_1f1b")``::

        tick     0   1   2   3   4   5   6   7   8   9   10  11  12  13  14  15  16  17  18  19  20
        stage 0  F0a F1a F2a F0b F1b F2b .   B0b --- .   B1b --- .   B2b --- B0a --- B1a --- B2a ---
        stage 1  .   F0a F1a F2a F0b B0b --- F1b B1b --- F2b B2b --- B0a --- B1a --- B2a --- .   .
    """
    rounds = _rounds(num_micro_batches, num_stages)
    chunks = stage_chunks(stage, num_stages, virtual_stages)
    forwards = [Action("forward", m, k) for micro_batches in rounds for k in chunks for m in micro_batches]
    backwards = [Action("backward", m, k) for micro_batches in rounds for k in reversed(chunks) for m in micro_batches]
    warm_up = min((virtual_stages - 1) * len(rounds[0]) + 2 * (num_stages - 1 - stage), len(forwards))
    compute = _one_forward_one_backward(forwards, backwards, warm_up)
    return _with_messages(compute, stage, num_stages, virtual_stages, "loop")


def _rounds(num_micro_batches: int, num_stages: int) -> list[range]:
    """The micro-batches in ``M // S`` consecutive rounds (at least one), as even as possible, longer ones first."""
    count = max(1, num_micro_batches // num_stages)
    size, longer = divmod(num_micro_batches, count)
    rounds, start = [], 0
    for r in range(count):
        end = start + size + (1 if r < longer else 0)
        rounds.append(range(start, end))
        start = end
    return rounds


def zero_bubble(stage: int, num_stages: int, num_micro_batches: int, virtual_stages: int = 1) -> list[Action]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism"): 1F1B with each backward split into the input gradient
    (``I``), which the stage before waits for, and the weight gradient (``W``), which nobody waits for. Stage ``s``
    defers its first ``s`` weight gradients: the ``I`` reach the first stage sooner, and the deferred ``W`` fill the
    cool-down. A third of 1F1B's bubble when ``F``, ``I`` and ``W`` take equal time; at most ``S`` micro-batches
    in flight on any stage (1F1B's peak, on its first stage). One chunk per stage
    (``render_timeline(4, 8, "zero_bubble")``)::

        tick     0  1  2  3  4  5  6  7  8  9  10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26
        stage 0  F0 F1 F2 F3 .  .  .  I0 W0 F4 I1 W1 F5 I2 W2 F6 I3 W3 F7 I4 W4 I5 W5 I6 W6 I7 W7
        stage 1  .  F0 F1 F2 .  .  I0 F3 I1 W0 F4 I2 W1 F5 I3 W2 F6 I4 W3 F7 I5 W4 I6 W5 I7 W6 W7
        stage 2  .  .  F0 F1 .  I0 F2 I1 F3 I2 W0 F4 I3 W1 F5 I4 W2 F6 I5 W3 F7 I6 W4 I7 W5 W6 W7
        stage 3  .  .  .  F0 I0 F1 I1 F2 I2 F3 I3 W0 F4 I4 W1 F5 I5 W2 F6 I6 W3 F7 I7 W4 W5 W6 W7
    """
    warm_up = min(num_stages - stage - 1, num_micro_batches)
    forwards = [Action("forward", m, stage) for m in range(num_micro_batches)]
    inputs = [Action("backward_input", m, stage) for m in range(num_micro_batches)]
    weights = [Action("backward_weight", m, stage) for m in range(num_micro_batches)]
    compute = forwards[:warm_up]
    for n, input_gradient in enumerate(inputs):  # the n-th input gradient, after its forward in steady state
        compute += [forwards[warm_up + n]] if warm_up + n < num_micro_batches else []
        compute.append(input_gradient)
        compute += [weights[n - stage]] if n >= stage else []
    return _with_messages(compute + weights[max(0, num_micro_batches - stage) :], stage, num_stages, 1, "loop")


def zbv(stage: int, num_stages: int, num_micro_batches: int, virtual_stages: int = 2) -> list[Action]:
    """ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", section 6; torch's ``ScheduleZBVZeroBubble``): two
    chunks per stage in a V, chunk ``stage`` on the way down (``a``) and chunk ``2S-1-stage`` on the way back up
    (``b``), so the first stage computes the loss and the last stage passes its activations to itself. Backwards
    are split into input and weight gradients, the weight gradients filling the gaps. No bubble in the steady
    state when ``F``, ``I`` and ``W`` take equal time; at most ``2S`` chunk activations (``S`` micro-batches of
    the whole stage, 1F1B's peak) in flight on any stage.

    The phases: forwards down the V to fill the pipeline (``2(S-stage)-1``), then forwards alternating between
    the chunks (``stage``), then ``S-stage`` rounds of forward, input and weight gradient of the upper chunk;
    the steady state runs forward, input and weight gradient of each chunk in turn; the cool-down drains the input
    gradients first and the deferred weight gradients last. The phases assume at least ``2S-1`` micro-batches:
    with fewer, the schedule is planned for ``2S-1`` and the actions of micro-batches that do not exist are left
    out (which keeps the order valid: actions depend only on actions of their own micro-batch).
    ``render_timeline(2, 4, "zbv")``::

        tick     0   1   2   3   4   5   6   7   8   9   10  11  12  13  14  15  16  17  18  19  20  21  22  23  24
        stage 0  F0a F1a F2a F0b I0b W0b F1b I1b W1b F3a I0a W0a F2b I2b W2b I1a W1a F3b I3b W3b I2a W2a I3a W3a .
        stage 1  .   F0a F0b F1a F1b I0b W0b F2a I0a W0a F2b I1b W1b F3a I1a W1a F3b I2b W2b I2a I3b I3a W2a W3b W3a
    """
    down, up = stage, 2 * num_stages - 1 - stage
    planned = max(num_micro_batches, 2 * num_stages - 1)
    done = {(kind, chunk): 0 for kind in ("forward", "backward_input", "backward_weight") for chunk in (down, up)}
    compute: list[Action] = []

    def run(kind: ActionKind, chunk: int) -> None:  # the chunk's next micro-batch for this kind
        compute.append(Action(kind, done[kind, chunk], chunk))
        done[kind, chunk] += 1

    for _ in range(2 * (num_stages - stage) - 1):
        run("forward", down)
    for _ in range(stage):
        run("forward", up)
        run("forward", down)
    for _ in range(num_stages - stage):
        for kind in ("forward", "backward_input", "backward_weight"):
            run(kind, up)
    while done["forward", up] < done["forward", down] or done["forward", down] < planned:
        if done["forward", down] < planned:
            run("forward", down)
        for kind in ("backward_input", "backward_weight"):
            run(kind, down)
        for kind in ("forward", "backward_input", "backward_weight"):
            run(kind, up)
    for _ in range(stage):
        run("backward_input", down)
        run("backward_input", up)
    for _ in range(num_stages - stage):
        run("backward_input", down)
        run("backward_weight", down)
    for chunk in (up, down):
        while done["backward_weight", chunk] < done["backward_input", chunk]:
            run("backward_weight", chunk)
    compute = [a for a in compute if a.micro_batch < num_micro_batches]
    return _with_messages(compute, stage, num_stages, 2, "v")


# ---- bubble formulas: the idle share of a step with F = I = W (a full backward B = I + W), equal chunks ---------


def _fill_and_drain_bubble(num_stages: int, num_micro_batches: int, virtual_stages: int) -> float:
    """GPipe and 1F1B: a stage idles while the pipeline fills, ``(S-1)·F``, and drains, ``(S-1)·B``, beside its
    ``M·(F+B)`` of work: ``(S-1)/(M+S-1)``."""
    return (num_stages - 1) / (num_micro_batches + num_stages - 1)


def _drain_of_input_gradients_bubble(num_stages: int, num_micro_batches: int, virtual_stages: int) -> float:
    """GPipe with deferred weight gradients: the drain passes only input gradients, ``(S-1)·I``:
    ``2(S-1)/(3M+2(S-1))``."""
    idle = 2 * (num_stages - 1)
    return idle / (3 * num_micro_batches + idle)


def _interleaved_bubble(num_stages: int, num_micro_batches: int, virtual_stages: int) -> float:
    """Interleaved 1F1B: the fill and drain pass chunks ``v`` times smaller: ``(S-1)/(v·M+S-1)`` (every ``M >= S``
    with rounds of at least ``S``)."""
    return (num_stages - 1) / (virtual_stages * num_micro_batches + num_stages - 1)


def _zero_bubble_h1_bubble(num_stages: int, num_micro_batches: int, virtual_stages: int) -> float:
    """ZB-H1: the deferred weight gradients fill all but ``(S-1)·(F+I-W) = (S-1)·F`` of 1F1B's ``(S-1)·(F+I+W)``:
    ``(S-1)/(3M+S-1)``, a third of 1F1B's idle time (``M >= S``)."""
    return (num_stages - 1) / (3 * num_micro_batches + num_stages - 1)


def _zbv_bubble(num_stages: int, num_micro_batches: int, virtual_stages: int) -> float:
    """ZB-V: only the first forward's trip down the V, ``S-1`` chunk ticks, against ``6M`` of work per stage:
    ``(S-1)/(6M+S-1)``, half of ZB-H1's idle time (``M >= 2S-1``; fewer leave gaps in the warm-up)."""
    return (num_stages - 1) / (6 * num_micro_batches + num_stages - 1)


SCHEDULES: dict[str, PipelineSchedule] = {
    "gpipe": gpipe_schedule(),
    "1f1b": PipelineSchedule("1f1b", one_f_one_b, per_micro_batch=True, bubble_formula=_fill_and_drain_bubble),
    "interleaved_1f1b": PipelineSchedule(
        "interleaved_1f1b", interleaved_one_f_one_b, per_micro_batch=True, virtual_stages=2, min_virtual_stages=2,
        max_virtual_stages=None, bubble_formula=_interleaved_bubble,
    ),
    "zero_bubble": PipelineSchedule(
        "zero_bubble", zero_bubble, per_micro_batch=True, bubble_formula=_zero_bubble_h1_bubble
    ),
    "zbv": PipelineSchedule(
        "zbv", zbv, per_micro_batch=True, placement="v", virtual_stages=2, min_virtual_stages=2,
        max_virtual_stages=2, bubble_formula=_zbv_bubble,
    ),
}


def custom_schedule(
    actions: StageActions,
    num_stages: int = 2,
    num_micro_batches: int | None = None,
    virtual_stages: int = 1,
    placement: Placement = "loop",
    per_micro_batch: bool | None = None,
) -> PipelineSchedule:
    """The user's function ``(stage, num_stages, num_micro_batches, virtual_stages) -> list[Action]`` as a schedule
    (named after the function) that runs with ``virtual_stages`` or more chunks per stage (exactly 2 in a V).
    ``per_micro_batch`` (``None``: read from the lists for ``num_stages`` stages and ``num_micro_batches``, by
    default ``4·num_stages``): whether some stage runs a forward after a backward, which needs a loss per
    micro-batch."""
    if per_micro_batch is None:
        per_micro_batch = any(
            _forward_after_backward(actions(stage, num_stages, num_micro_batches or 4 * num_stages, virtual_stages))
            for stage in range(num_stages)
        )
    fixed = placement == "v"
    return PipelineSchedule(
        getattr(actions, "__name__", "custom"), actions, per_micro_batch, placement,
        virtual_stages=2 if fixed else virtual_stages, min_virtual_stages=2 if fixed else 1,
        max_virtual_stages=2 if fixed else None,
    )


def _forward_after_backward(actions: list[Action]) -> bool:
    """Whether a forward follows a backward (of any kind) in ``actions``."""
    backwards = [i for i, a in enumerate(actions) if a.kind in COMPUTE_KINDS and a.kind != "forward"]
    return bool(backwards) and any(a.kind == "forward" for a in actions[backwards[0] :])


def check_schedule(
    schedule: PipelineSchedule, num_stages: int, num_micro_batches: int, virtual_stages: int | None = None
) -> None:
    """Raise a ``ValueError`` naming the stage, the action and the broken rule unless ``schedule`` runs correctly
    with every micro-batch count from 1 to ``num_micro_batches`` (a smaller last batch splits into fewer)."""
    for count in range(1, num_micro_batches + 1):
        clock_cycles(num_stages, count, schedule, virtual_stages)


# ---- the simulator ----------------------------------------------------------------------------------------------

# Ticks of each compute action in the ideal timeline: a chunk's forward, input gradient and weight gradient cost
# the same (the Zero Bubble paper's assumption); a full backward is both gradients. Messages are free and instant.
DEFAULT_COSTS: dict[str, int] = {"forward": 1, "backward_input": 1, "backward_weight": 1, "backward": 2}
_ACTIVATION, _GRADIENT = "activation", "gradient"


class ScheduledAction(NamedTuple):
    """A compute action at its place in the ideal timeline: it runs from tick ``start`` up to ``end``."""

    start: int
    end: int
    action: Action


@dataclass(frozen=True)
class Simulation:
    """A schedule executed with ideal costs (:func:`clock_cycles`).

    ``intervals[stage]`` holds the stage's compute actions at their ticks; ``peak_in_flight[stage]`` the most
    (chunk, micro-batch) pairs whose forward had run and whose backward (or weight gradient) had not, at any
    point: the activations the stage holds at once, in units of one chunk's activations of one micro-batch.
    """

    intervals: tuple[tuple[ScheduledAction, ...], ...]
    peak_in_flight: tuple[int, ...]

    @property
    def makespan(self) -> int:
        """Ticks from the first action's start to the last one's end."""
        return max((stage[-1].end for stage in self.intervals if stage), default=0)

    @property
    def bubble_fraction(self) -> float:
        """The idle share of the makespan, over all stages."""
        busy = sum(a.end - a.start for stage in self.intervals for a in stage)
        total = self.makespan * len(self.intervals)
        return (total - busy) / total if total else 0.0


def clock_cycles(
    num_stages: int,
    num_micro_batches: int,
    schedule: str | PipelineSchedule = "gpipe",
    virtual_stages: int | None = None,
    costs: dict[str, int] = DEFAULT_COSTS,
) -> Simulation:
    """Check ``schedule``'s lists and execute them with ``costs`` ticks per compute action (:data:`DEFAULT_COSTS`).

    Each stage runs its list strictly in order; a send is instant and never blocks, a receive waits until the
    matching send has run. A ``ValueError`` names the stage, the action and the rule for: a (chunk, micro-batch)
    run twice or never, an action before what it needs (its input, its output's gradient, its forward), a message
    whose sender and receiver disagree on the order, and a deadlock (no stage can proceed while actions remain).
    """
    schedule = SCHEDULES[schedule] if isinstance(schedule, str) else schedule
    v = schedule.checked_virtual_stages(virtual_stages)
    where = (
        f"schedule {schedule.name!r} with {_count(num_stages, 'stage')}, {_count(num_micro_batches, 'micro-batch')}"
        f" and {_count(v, 'chunk')} per stage"
    )
    lists = [schedule.actions(stage, num_stages, num_micro_batches, v) for stage in range(num_stages)]
    grid = _Grid(num_stages, num_micro_batches, v, schedule.placement, schedule.per_micro_batch, where)
    for stage, actions in enumerate(lists):
        grid.check_stage(stage, actions)
    grid.check_message_order(lists)
    return Simulation(_run(lists, grid, costs), tuple(_peak_in_flight(actions) for actions in lists))


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" if number == 1 else f"{number} {noun}es" if noun.endswith("h") else f"{number} {noun}s"


@dataclass(frozen=True)
class _Grid:
    """The shape of one step (stages, micro-batches, chunks and where they live) and the rules a stage's list obeys."""

    num_stages: int
    num_micro_batches: int
    virtual_stages: int
    placement: Placement
    per_micro_batch: bool
    where: str

    @property
    def last_chunk(self) -> int:
        return self.num_stages * self.virtual_stages - 1

    def owner(self, chunk: int) -> int:
        return owner(chunk, self.num_stages, self.placement)

    def fail(self, stage: int, index: int | None, action: Action, rule: str) -> ValueError:
        at = f"action {index}, {action}," if index is not None else f"{action}"
        return ValueError(f"{self.where}: stage {stage}'s {at} {rule}")

    def check_stage(self, stage: int, actions: list[Action]) -> None:
        """Each action where its inputs are ready, each (chunk, micro-batch) forwarded and back-propagated once."""
        done: dict[str, set[tuple[int, int]]] = {kind: set() for kind in get_args(ActionKind)}
        local = stage_chunks(stage, self.num_stages, self.virtual_stages, self.placement)
        for index, action in enumerate(actions):
            rule = self._broken_rule(stage, action, done, local)
            if rule is not None:
                raise self.fail(stage, index, action, rule)
            done[action.kind].add((action.chunk, action.micro_batch))
        for k in local:
            for m in range(self.num_micro_batches):
                needed = [Action("forward", m, k)]
                if (k, m) in done["backward_input"]:
                    needed.append(Action("backward_weight", m, k))
                elif (k, m) not in done["backward"]:
                    needed.append(Action("backward", m, k))
                for action in needed:
                    if (k, m) not in done[action.kind]:
                        rule = "never runs: every (chunk, micro-batch) needs one forward and one backward (full, or"
                        raise self.fail(stage, None, action, rule + " input then weight gradients) on its stage")

    def _broken_rule(
        self, stage: int, action: Action, done: dict[str, set[tuple[int, int]]], local: list[int]
    ) -> str | None:
        """Why ``action`` cannot run after the actions ``done`` on ``stage`` (which holds the chunks ``local``), or
        ``None``."""
        k, m, kind = action.chunk, action.micro_batch, action.kind
        if not 0 <= k <= self.last_chunk:
            return f"names a chunk outside 0..{self.last_chunk}"
        if k not in local:
            return f"runs a chunk that the {self.placement!r} placement puts on stage {self.owner(k)}"
        if not 0 <= m < self.num_micro_batches:
            return f"names a micro-batch outside 0..{self.num_micro_batches - 1}"
        if action.recompute and kind != "forward":
            return "re-computes, which only a forward can"
        backed = done["backward"] | done["backward_input"]
        if (k, m) in (backed if kind in INPUT_GRADIENT_KINDS else done[kind]):
            return "runs twice: each action happens once per (chunk, micro-batch)"
        if kind in ("recv", "send_grad") and not self._crosses_stages(stage, k - 1):
            return "crosses no stage boundary: the chunk's input is the data or computed on this stage"
        if kind in ("send", "recv_grad") and not self._crosses_stages(stage, k + 1):
            return "crosses no stage boundary: the chunk's output feeds the loss or a chunk on this stage"
        for kinds, (chunk, micro_batch), what in self._prerequisites(stage, action):
            if not any((chunk, micro_batch) in done[before] for before in kinds):
                return f"runs before {what}"
        if kind in INPUT_GRADIENT_KINDS and k == self.last_chunk and not self.per_micro_batch:
            missing = [mb for mb in range(self.num_micro_batches) if (k, mb) not in done["forward"]]
            if missing:
                return (
                    f"runs before the forward of micro-batch {missing[0]}: the loss is computed on the whole"
                    " mini-batch, so every forward of the last chunk comes first (a schedule that interleaves"
                    " needs per_micro_batch=True)"
                )
        return None

    def _crosses_stages(self, stage: int, chunk: int) -> bool:
        """Whether a message between ``stage`` and ``chunk`` crosses to another stage (``chunk`` exists)."""
        return 0 <= chunk <= self.last_chunk and self.owner(chunk) != stage

    def _prerequisites(
        self, stage: int, action: Action
    ) -> list[tuple[tuple[ActionKind, ...], tuple[int, int], str]]:
        """What must come before ``action`` on its stage: (any of these kinds, of this (chunk, micro-batch), why)."""
        k, m, kind = action.chunk, action.micro_batch, action.kind
        if kind == "forward" and k > 0:
            if self._crosses_stages(stage, k - 1):
                return [(("recv",), (k, m), "its receive, which provides its input")]
            return [(("forward",), (k - 1, m), f"forward(chunk {k - 1}, micro-batch {m}), which provides its input")]
        if kind == "send":
            return [(("forward",), (k, m), "its forward")]
        if kind in INPUT_GRADIENT_KINDS:
            needed = [(("forward",), (k, m), "its forward")]
            if self._crosses_stages(stage, k + 1):
                needed.append((("recv_grad",), (k, m), "its recv_grad, which provides its output's gradient"))
            elif k < self.last_chunk:
                why = f"the backward of chunk {k + 1}, micro-batch {m}, which provides its output's gradient"
                needed.append((INPUT_GRADIENT_KINDS, (k + 1, m), why))
            return needed
        if kind == "backward_weight":
            return [(("backward_input",), (k, m), "its backward_input (a full backward computes both gradients)")]
        if kind == "send_grad":
            return [(INPUT_GRADIENT_KINDS, (k, m), "its backward")]
        return []

    def message(self, stage: int, action: Action) -> tuple[tuple[int, int, str], tuple[int, int]] | None:
        """The channel ``(sender, receiver, kind)`` and the message ``(boundary chunk, micro-batch)`` that ``action``
        sends or receives; the boundary is the chunk an activation enters, or whose input a gradient is."""
        k, m, kind = action.chunk, action.micro_batch, action.kind
        if kind == "send":
            return (stage, self.owner(k + 1), _ACTIVATION), (k + 1, m)
        if kind == "recv":
            return (self.owner(k - 1), stage, _ACTIVATION), (k, m)
        if kind == "send_grad":
            return (stage, self.owner(k - 1), _GRADIENT), (k, m)
        if kind == "recv_grad":
            return (self.owner(k + 1), stage, _GRADIENT), (k + 1, m)
        return None

    def check_message_order(self, lists: list[list[Action]]) -> None:
        """For each pair of stages and each kind of message, the receiver receives in the order the sender sends:
        point-to-point messages match in order, without tags."""
        sent: dict[tuple[int, int, str], list[tuple[tuple[int, int], int, Action]]] = {}
        received: dict[tuple[int, int, str], list[tuple[tuple[int, int], int, Action]]] = {}
        for stage, actions in enumerate(lists):
            for index, action in enumerate(actions):
                found = self.message(stage, action)
                if found is not None:
                    channel, message = found
                    side = sent if action.kind.startswith("send") else received
                    side.setdefault(channel, []).append((message, index, action))
        for channel in sorted(set(sent) | set(received)):
            sender, receiver, kind = channel
            sends, receives = sent.get(channel, []), received.get(channel, [])
            for n in range(max(len(sends), len(receives))):
                if n >= len(receives):
                    _, index, action = sends[n]
                    raise self.fail(sender, index, action, f"is an {kind} that stage {receiver} never receives")
                if n >= len(sends):
                    _, index, action = receives[n]
                    raise self.fail(receiver, index, action, f"waits for an {kind} that stage {sender} never sends")
                if sends[n][0] != receives[n][0]:
                    _, index, action = receives[n]
                    raise self.fail(
                        receiver, index, action,
                        f"is its receive number {n} from stage {sender}, but stage {sender}'s send number {n} there is"
                        f" {sends[n][2]} (action {sends[n][1]}): a stage must receive its {kind}s in the order they"
                        " are sent",
                    )


def _run(lists: list[list[Action]], grid: _Grid, costs: dict[str, int]) -> tuple[tuple[ScheduledAction, ...], ...]:
    """Each stage's compute actions at the ticks they run, each stage going as far as its receives allow; a
    ``ValueError`` if every unfinished stage waits for a message that will never be sent."""
    position, clock = [0] * len(lists), [0] * len(lists)
    sent_at: dict[tuple[int, int, str], list[int]] = {}
    taken: dict[tuple[int, int, str], int] = {}
    intervals: list[list[ScheduledAction]] = [[] for _ in lists]
    progress = True
    while progress:
        progress = False
        for stage, actions in enumerate(lists):
            while position[stage] < len(actions):
                action = actions[position[stage]]
                found = grid.message(stage, action)
                if action.kind in COMPUTE_KINDS:
                    start = clock[stage]
                    clock[stage] += costs[action.kind]
                    intervals[stage].append(ScheduledAction(start, clock[stage], action))
                elif action.kind in ("send", "send_grad"):
                    assert found is not None
                    sent_at.setdefault(found[0], []).append(clock[stage])
                else:
                    assert found is not None
                    channel = found[0]
                    n = taken.get(channel, 0)
                    if n >= len(sent_at.get(channel, [])):
                        break  # blocked: the message has not been sent yet
                    clock[stage] = max(clock[stage], sent_at[channel][n])
                    taken[channel] = n + 1
                position[stage] += 1
                progress = True
    blocked = [stage for stage, actions in enumerate(lists) if position[stage] < len(actions)]
    if blocked:
        waits = "; ".join(
            f"stage {s} waits at action {position[s]}, {lists[s][position[s]]}, for stage"
            f" {grid.message(s, lists[s][position[s]])[0][0]}"  # type: ignore[index]
            for s in blocked
        )
        raise ValueError(f"{grid.where}: deadlock, no stage can proceed while actions remain: {waits}.")
    return tuple(tuple(stage) for stage in intervals)


def _peak_in_flight(actions: list[Action]) -> int:
    """The most (chunk, micro-batch) pairs forwarded and not yet back-propagated (weights included) at once."""
    held = peak = 0
    for action in actions:
        if action.kind == "forward":
            held += 1
            peak = max(peak, held)
        elif action.kind in ("backward", "backward_weight"):
            held -= 1
    return peak


# ---- the picture ------------------------------------------------------------------------------------------------


def render_timeline(
    num_stages: int,
    num_micro_batches: int,
    schedule: str | PipelineSchedule = "gpipe",
    virtual_stages: int | None = None,
) -> str:
    """The ideal timeline (:func:`clock_cycles`) as a text table, one column per tick.

    ``F3`` is the forward of micro-batch 3, ``B3`` its full backward, ``I3`` its input gradient and ``W3`` its
    weight gradient; an action of several ticks continues with ``--``; ``.`` is idle. With several chunks per
    stage a letter names the stage's chunk, in model order: ``F3a`` runs the stage's first chunk, ``F3b`` its
    second (in a V, ``a`` is on the way down and ``b`` on the way back up).
    """
    schedule = SCHEDULES[schedule] if isinstance(schedule, str) else schedule
    v = schedule.checked_virtual_stages(virtual_stages)
    simulation = clock_cycles(num_stages, num_micro_batches, schedule, v)
    letters = {k: chr(ord("a") + i) for s in range(num_stages) for i, k in enumerate(schedule.chunks(s, num_stages, v))}
    short = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W"}

    def label(action: Action) -> str:
        return f"{short[action.kind]}{action.micro_batch}{letters[action.chunk] if v > 1 else ''}"

    width = max(3, len(f"F{num_micro_batches - 1}") + (2 if v > 1 else 1))
    cells = []
    for stage in simulation.intervals:
        row = ["."] * simulation.makespan
        for start, end, action in stage:
            row[start:end] = [label(action)] + ["-" * (width - 1)] * (end - start - 1)
        cells.append(row)
    header = "tick     " + "".join(f"{tick:<{width}}" for tick in range(simulation.makespan))
    rows = [f"stage {s:<3}" + "".join(f"{cell:<{width}}" for cell in row) for s, row in enumerate(cells)]
    return "\n".join(line.rstrip() for line in [header, *rows])


def phases(actions: list[Action], num_micro_batches: int) -> tuple[list[Action], list[Action]]:
    """The forward phase (run inside the pipelined call) and the backward phase (run by ``backward``) of a stage's
    actions, for the engine that runs whole-batch schedules; a ``ValueError`` if the schedule interleaves them,
    misses a micro-batch or splits its backwards."""
    split = next((i for i, a in enumerate(actions) if a.kind not in ("recv", "forward", "send")), len(actions))
    forwards, backwards = actions[:split], actions[split:]
    if any(action.kind in ("recv", "forward", "send") for action in backwards):
        raise ValueError(
            "the schedule runs a forward after a backward; the loss is computed on the whole mini-batch, so every"
            " forward must come before the first backward."
        )
    if any(action.kind in ("backward_input", "backward_weight") for action in backwards):
        raise ValueError(
            "the schedule splits its backwards into input and weight gradients, which the engine cannot run yet."
        )
    for phase, kind in ((forwards, "forward"), (backwards, "backward")):
        done = sorted(action.micro_batch for action in phase if action.kind == kind)
        if backwards and done != list(range(num_micro_batches)):
            raise ValueError(
                f"the schedule's {kind}s cover micro-batches {done}, not each of 0..{num_micro_batches - 1} once."
            )
    return forwards, backwards
