"""A schedule's step time, bubble and peak activation memory per stage, predicted from measured costs.

The pure core of choosing a schedule: the schedule's own actions executed by the simulator
(:func:`~lightning_pipe.schedules.simulator.clock_cycles`) with the seconds each part of the work takes, and a
message taking ``send_time`` to arrive and the runtime spending ``action_time`` of its own before each compute
action::

    >>> from lightning_pipe.schedules.planner import ComputeCosts, predict
    >>> stage = ComputeCosts(forward=0.016, input_gradient=0.016, weight_gradient=0.016)
    >>> round(predict("gpipe", 4, 8, stage).step, 3)      # (M + S - 1) x (F + I + W)
    0.528
    >>> round(predict("zbv", 4, 8, stage).step, 3)
    0.408
    >>> round(predict("gpipe", 4, 8, stage, send_time=0.001, action_time=0.0005).step, 3)  # + 2(S-1) messages
    0.545

Both default to 0: the ideal step of the schedule's own tick table. :class:`RuntimeCosts` carries the two measured on
a machine (``lightning_pipe.schedules.choice.runtime_costs``), and :func:`fitted_send_time` finds the message time
that makes a prediction meet a measured step.

Costs are given per stage (``S`` of them, each stage's chunks sharing its cost evenly) or per chunk (``S·v``, in model
order: the way to say that the last blocks, the head and the loss, are heavy whatever stage holds them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

from lightning_pipe.schedules.actions import PipelineSchedule, RecomputeMode, with_recompute
from lightning_pipe.schedules.builtin import SCHEDULES
from lightning_pipe.schedules.simulator import Simulation, clock_cycles, peak_held


@dataclass(frozen=True)
class ComputeCosts:
    """What one micro-batch costs a stage (or a chunk): seconds of forward, input gradient and weight gradient, and
    the bytes of activations it holds from its forward until its backward (``input_bytes`` of them when its forward
    is re-computed in backward: its input)."""

    forward: float
    input_gradient: float
    weight_gradient: float
    activation_bytes: float = 0.0
    input_bytes: float = 0.0

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"ComputeCosts({field.name}={value!r}): a cost is a number, 0 or more")

    def share(self, parts: int) -> ComputeCosts:
        """One of ``parts`` equal shares: what each chunk of a stage of ``parts`` chunks costs."""
        return ComputeCosts(*(getattr(self, field.name) / parts for field in fields(self)))


@dataclass(frozen=True)
class RuntimeCosts:
    """What the runtime itself adds to a step, measured on a machine: ``action_time`` seconds before each compute
    action (from one compute's end to the next one's start when no message is waited for, plus what a compute takes
    beyond its kernels), and ``send_time`` seconds for a message to arrive. Both 0: the ideal step."""

    action_time: float = 0.0
    send_time: float = 0.0

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"RuntimeCosts({field.name}={value!r}): seconds, 0 or more")

    def __str__(self) -> str:
        return f"{self.action_time * 1e3:.2f} ms per action, {self.send_time * 1e3:.2f} ms per message"


@dataclass(frozen=True)
class Prediction:
    """A schedule's step predicted from costs: ``step`` seconds, the idle share ``bubble`` (of every stage's time in
    the step), each stage's idle share, and each stage's peak activation memory (bytes)."""

    step: float
    bubble: float
    stage_bubbles: tuple[float, ...]
    peak_activation_bytes: tuple[float, ...]
    simulation: Simulation


def predict(
    schedule: str | PipelineSchedule,
    num_stages: int,
    num_micro_batches: int,
    costs: ComputeCosts | Sequence[ComputeCosts],
    virtual_stages: int | None = None,
    send_time: float = 0.0,
    recompute: RecomputeMode = "never",
    action_time: float = 0.0,
) -> Prediction:
    """The step of ``schedule`` with ``costs`` (one for every stage, one per stage, or one per chunk), messages
    that take ``send_time`` seconds to arrive and ``action_time`` seconds of the runtime's own before each compute
    action (:class:`RuntimeCosts`). With ``recompute`` (the ``checkpoint`` option) a re-computed forward
    runs again before its (input-gradient) backward and holds only its input until then."""
    schedule = SCHEDULES[schedule] if isinstance(schedule, str) else schedule
    if recompute != "never":
        plain = schedule.actions
        schedule = replace(schedule, actions=lambda s, n, m, v: with_recompute(plain(s, n, m, v), recompute))
    v = schedule.checked_virtual_stages(virtual_stages)
    chunks = num_stages * v
    if isinstance(costs, ComputeCosts):
        per_chunk = [costs.share(v)] * chunks
    elif len(costs) == num_stages:
        per_chunk = [costs[schedule.owner(k, num_stages)].share(v) for k in range(chunks)]
    elif len(costs) == chunks:
        per_chunk = list(costs)
    else:
        raise ValueError(
            f"predict({schedule.name!r}, num_stages={num_stages}, virtual_stages={v}): {len(costs)} costs given; give"
            f" one ComputeCosts for all, {num_stages} (one per stage) or {chunks} (one per chunk, in model order)"
        )
    if not send_time >= 0:
        raise ValueError(f"predict(send_time={send_time!r}): the seconds a message takes to arrive, 0 or more")
    if not action_time >= 0:
        raise ValueError(f"predict(action_time={action_time!r}): the runtime's own seconds per action, 0 or more")
    simulation = clock_cycles(
        num_stages, num_micro_batches, schedule, v,
        [{"forward": c.forward, "backward_input": c.input_gradient, "backward_weight": c.weight_gradient,
          "backward": c.input_gradient + c.weight_gradient} for c in per_chunk],
        send_time, action_time,
    )
    step = simulation.makespan
    busy = [sum(a.end - a.start for a in stage) for stage in simulation.intervals]
    lists = [schedule.actions(stage, num_stages, num_micro_batches, v) for stage in range(num_stages)]
    return Prediction(
        step=step,
        bubble=simulation.bubble_fraction,
        stage_bubbles=tuple(1 - b / step if step else 0.0 for b in busy),
        peak_activation_bytes=tuple(
            peak_held(actions, lambda k: per_chunk[k].activation_bytes, lambda k: per_chunk[k].input_bytes)
            for actions in lists
        ),
        simulation=simulation,
    )


def fitted_send_time(
    measured_step: float,
    schedule: str | PipelineSchedule,
    num_stages: int,
    num_micro_batches: int,
    costs: ComputeCosts | Sequence[ComputeCosts],
    virtual_stages: int | None = None,
    action_time: float = 0.0,
    tolerance: float = 1e-6,
) -> float:
    """The message time (seconds) at which :func:`predict` gives ``measured_step``: how a machine's ``send_time`` is
    found from one measured step of a configuration whose compute costs are known. 0 where the prediction without
    message time already reaches the measured step (the messages cost nothing visible)."""
    def step(send_time: float) -> float:
        return predict(schedule, num_stages, num_micro_batches, costs, virtual_stages, send_time,
                       action_time=action_time).step

    if step(0.0) >= measured_step:
        return 0.0
    low, high = 0.0, measured_step  # a message as long as the whole step overshoots it: the step grows with it
    while high - low > tolerance:
        middle = (low + high) / 2
        low, high = (middle, high) if step(middle) < measured_step else (low, middle)
    return (low + high) / 2
