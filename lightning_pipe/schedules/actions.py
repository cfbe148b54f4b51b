"""What a schedule is: the ordered actions each stage performs in one training step, which the engine executes.

The pipelined blocks are cut into ``S·v`` contiguous *chunks* (``S`` stages, ``v`` virtual stages: chunks per
stage); chunk 0 runs first, chunk ``S·v - 1`` last and feeds the loss. A placement puts each chunk on a stage:
``"loop"``, chunk ``k`` on stage ``k % S``; ``"v"`` (``v = 2``), down the stages and back up, so that the first
stage holds the first and the last chunk. A schedule lists, for each stage, its forwards and backwards of (chunk,
micro-batch) pairs and the messages between them; the engine executes each list strictly in order.

GPipe with 3 stages and 4 micro-batches, at the ticks the simulator finds when a forward (``F``) takes one tick and
a backward (``B``, input and weight gradients) two (``.`` is the idle bubble; :mod:`~lightning_pipe.schedules.simulator`
draws it from the actions: ``render_timeline(3, 4)``)::

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
from typing import Literal

# recv: wait for a micro-batch's activations from the stage holding the previous chunk; send: pass a chunk's output
# to the stage holding the next one; recv_grad / send_grad: the same for gradients, in the other direction. forward
# and backward run one chunk's blocks; backward_input computes only the gradient of the chunk's input (what the
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
    is designed for (``None``: the simulated one, :func:`~lightning_pipe.schedules.simulator.ideal_bubble`).
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


def with_messages(
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
