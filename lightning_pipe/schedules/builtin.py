"""The built-in schedules: GPipe, 1F1B, interleaved 1F1B, ZB-H1 (``zero_bubble``) and ZB-V (``zbv``), each a function
from a stage to its actions, with the bubble its paper's formula gives; :data:`SCHEDULES` holds them by name.

Each docstring draws its timeline, as :func:`~lightning_pipe.schedules.simulator.render_timeline` draws it.
"""

from __future__ import annotations

from dataclasses import replace

from lightning_pipe.schedules.actions import (
    Action, ActionKind, PipelineSchedule, StageActions, stage_chunks, with_messages,
)

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
    return with_messages(compute, stage, num_stages, 1, "loop")


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
    return with_messages(_one_forward_one_backward(forward, backward, warm_up), stage, num_stages, 1, "loop")


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
    return with_messages(compute, stage, num_stages, virtual_stages, "loop")


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
    return with_messages(compute + weights[max(0, num_micro_batches - stage) :], stage, num_stages, 1, "loop")


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
    return with_messages(compute, stage, num_stages, 2, "v")


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


