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
a machine (``lightning_pipe.schedules.choice.runtime_costs``); :func:`fitted_runtime_costs` finds them from a few
measured steps.

Costs are given per stage (``S`` of them, each stage's chunks sharing its cost evenly) or per chunk (``S·v``, in model
order: the way to say that the last blocks, the head and the loss, are heavy whatever stage holds them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
        _check_not_negative(self, "a cost is a number, 0 or more")

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
        _check_not_negative(self, "seconds, 0 or more")

    def __str__(self) -> str:
        return f"{self.action_time * 1e3:.2f} ms per action, {self.send_time * 1e3:.2f} ms per message"


def _check_not_negative(costs: ComputeCosts | RuntimeCosts, what: str) -> None:
    for field in fields(costs):
        value = getattr(costs, field.name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"{type(costs).__name__}({field.name}={value!r}): {what}")


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


@dataclass(frozen=True)
class MeasuredStep:
    """A step measured on a machine (``seconds``) of a configuration whose compute costs are known: what
    :func:`fitted_runtime_costs` finds the runtime's own costs from."""

    seconds: float
    schedule: str | PipelineSchedule
    num_stages: int
    num_micro_batches: int
    costs: ComputeCosts | Sequence[ComputeCosts]
    virtual_stages: int | None = None


def fitted_runtime_costs(steps: Sequence[MeasuredStep], tolerance: float = 1e-5) -> RuntimeCosts:
    """The runtime's costs (per compute action, per message) with which :func:`predict` comes closest to the measured
    ``steps``: the least squares of the relative errors. How a machine's costs are measured: a few small
    configurations, differing in how many actions and how many messages lie on their critical path (a GPipe and an
    interleaved schedule, say), each timed once its blocks' costs are profiled.

    The predicted step is the longest path through the schedule's actions, linear in both costs along each path, so
    the fit searches each cost by golden sections between 0 and the shortest measured step."""
    if not steps:
        raise ValueError("fitted_runtime_costs(steps=[]): give at least one measured step (two or more, differing in"
                         " their actions and messages, to tell the two costs apart)")

    def error(action_time: float, send_time: float) -> float:
        return sum(
            (predict(m.schedule, m.num_stages, m.num_micro_batches, m.costs, m.virtual_stages, send_time,
                     action_time=action_time).step / m.seconds - 1) ** 2
            for m in steps
        )

    bound = min(m.seconds for m in steps)
    best_send: dict[float, float] = {}

    def send_for(action_time: float) -> float:
        if action_time not in best_send:
            best_send[action_time] = _golden_minimum(lambda s: error(action_time, s), bound, tolerance)
        return best_send[action_time]

    action_time = _golden_minimum(lambda a: error(a, send_for(a)), bound, tolerance)
    return RuntimeCosts(action_time, send_for(action_time))


def _golden_minimum(function: Callable[[float], float], high: float, tolerance: float) -> float:
    """Where ``function`` is least on [0, ``high``] (golden-section search; the ends are candidates too)."""
    ratio = (5 ** 0.5 - 1) / 2
    low, top = 0.0, high
    a, b = top - ratio * (top - low), low + ratio * (top - low)
    fa, fb = function(a), function(b)
    while top - low > tolerance:
        if fa <= fb:
            top, b, fb = b, a, fa
            a = top - ratio * (top - low)
            fa = function(a)
        else:
            low, a, fa = a, b, fb
            b = low + ratio * (top - low)
            fb = function(b)
    middle = (low + top) / 2
    return min((0.0, middle, high), key=function)
