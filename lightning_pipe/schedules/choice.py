"""Choosing a schedule: every configuration (schedule x micro-batches x virtual stages x re-computation) predicted
from measured block costs, ranked by step time, and the fastest that fits a memory budget chosen, with why.

The pure core of ``lightning-pipe plan`` and ``GPipeStrategy(schedule="auto")``::

    >>> from lightning_pipe.schedules.choice import BlockCosts, CostModel, rank_configurations, choose
    >>> block = BlockCosts(samples=4, forward=0.004, input_gradient=0.004, weight_gradient=0.004,
    ...                    activation_bytes=4e6, input_bytes=1e6, parameter_bytes=1e6)
    >>> model = CostModel.measured([block] * 8, [block.scaled(16)] * 8)      # profiled at 4 and 16 samples
    >>> rows = rank_configurations(model, num_stages=4, batch_size=32)
    >>> choose(rows).configuration.schedule
    'zbv'

A block's time and activation bytes are affine in the micro-batch's sample count (``fixed + per_sample * n``),
fitted through the two sizes it was profiled at; a step always processes the whole batch, so a configuration with
more micro-batches runs more, smaller ones. A stage's memory is its parameters and their gradients (twice the
parameter bytes) plus its peak activations; the optimizer's state is not counted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import get_args

from lightning_pipe.schedules.actions import PipelineSchedule, RecomputeMode
from lightning_pipe.schedules.builtin import SCHEDULES, gpipe
from lightning_pipe.schedules.planner import ComputeCosts, RuntimeCosts, predict
from lightning_pipe.schedules.simulator import Simulation

RECOMPUTE_MODES: tuple[RecomputeMode, ...] = get_args(RecomputeMode)
# The schedules `schedule="auto"` may choose: those whose loss is on the last stage, as the rank layout fixed when the
# processes start assumes before the choice is made (zbv puts it on stage 0).
AUTO_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
# `schedule="auto"` until the choice: GPipe's layout (the loss on the last stage) for any chunk count.
AUTO = PipelineSchedule("auto", gpipe, per_micro_batch=False, max_virtual_stages=None)
INTERLEAVED_VIRTUAL_STAGES = (2, 4)
# The runtime's own cost per compute action and a message's time, by device type, beyond the blocks' profiled costs:
# what `schedule="auto"` and `lightning-pipe plan` add to them. Measured by the benchmark section "Planner
# accuracy (emulated)" (docs/benchmarks.md; `fitted_runtime_costs` on three small configurations, whose result the
# section states). CPU: gloo between the processes of this project's 2-core machine (measured 2026-12-03 18:07 UTC,
# load average 0.7 before, 6.8 after): 1.98 ms per action, which holds what the shared cores add, and a message's own
# time fitted to 0. No accelerator has been measured yet: a device type without an entry gets the CPU's (the Python
# around each action is the same code); `lightning-pipe plan --action-time/--send-time` override them.
MEASURED_RUNTIME_COSTS: dict[str, RuntimeCosts] = {"cpu": RuntimeCosts(action_time=0.00198, send_time=0.0)}
# Splits per-block costs into contiguous parts: (costs, parts) -> the blocks of each part.
Partition = Callable[[Sequence[float], int], list[range]]


@dataclass(frozen=True)
class BlockCosts:
    """What one block costs on a micro-batch of ``samples`` samples: seconds of forward, input gradient and weight
    gradient, the bytes its forward keeps for its backward, the bytes of its input, and its parameters' bytes."""

    samples: int
    forward: float
    input_gradient: float
    weight_gradient: float
    activation_bytes: float
    input_bytes: float
    parameter_bytes: float

    def scaled(self, samples: int) -> BlockCosts:
        """The costs at ``samples`` samples if every cost were proportional to the sample count (for examples and
        emulated models)."""
        factor = samples / self.samples
        sized = {f.name: getattr(self, f.name) * factor for f in fields(self) if f.name not in ("samples", "parameter_bytes")}
        return replace(self, samples=samples, **sized)


@dataclass(frozen=True)
class CostModel:
    """Each block's costs as a function of the micro-batch's sample count, through two profiled sizes."""

    small: tuple[BlockCosts, ...]
    large: tuple[BlockCosts, ...]

    @classmethod
    def measured(cls, small: Sequence[BlockCosts], large: Sequence[BlockCosts]) -> CostModel:
        if len(small) != len(large) or not small:
            raise ValueError(f"CostModel: {len(small)} and {len(large)} blocks profiled; give the same blocks twice")
        return cls(tuple(small), tuple(large))

    @property
    def num_blocks(self) -> int:
        return len(self.small)

    def at(self, samples: float) -> list[BlockCosts]:
        """Every block's costs on a micro-batch of ``samples`` samples: the line through the two profiled sizes (the
        one size, proportionally, when both are the same), never below zero."""
        blocks = []
        for low, high in zip(self.small, self.large):
            values = {}
            for name in ("forward", "input_gradient", "weight_gradient", "activation_bytes", "input_bytes"):
                a, b = getattr(low, name), getattr(high, name)
                if high.samples == low.samples:
                    value = a * samples / low.samples
                else:
                    value = a + (b - a) * (samples - low.samples) / (high.samples - low.samples)
                values[name] = max(0.0, value)
            blocks.append(BlockCosts(int(samples), parameter_bytes=low.parameter_bytes, **values))
        return blocks


@dataclass(frozen=True)
class Configuration:
    """One choice: the schedule, the micro-batches per batch, the model chunks per stage, the re-computation."""

    schedule: str
    num_micro_batches: int
    virtual_stages: int
    recompute: RecomputeMode

    def __str__(self) -> str:
        v = f", v={self.virtual_stages}" if SCHEDULES[self.schedule].max_virtual_stages != 1 else ""
        return f"{self.schedule} (M={self.num_micro_batches}{v}, checkpoint={self.recompute})"


@dataclass(frozen=True)
class PlannedConfiguration:
    """A configuration's prediction: the step (seconds), the idle share, each stage's peak activation bytes and
    its memory (parameters, their gradients and the peak activations), and whether the largest fits the budget."""

    configuration: Configuration
    step: float
    bubble: float
    peak_activation_bytes: tuple[float, ...]
    stage_memory_bytes: tuple[float, ...]
    fits: bool = True
    simulation: Simulation | None = field(default=None, compare=False, repr=False)  # the predicted timeline

    @property
    def memory_bytes(self) -> float:
        """The most any stage needs."""
        return max(self.stage_memory_bytes)


def configurations(
    num_stages: int,
    batch_size: int,
    num_blocks: int,
    schedules: Sequence[str] = tuple(SCHEDULES),
    micro_batches: Sequence[int] | None = None,
    virtual_stages: Sequence[int] | None = None,
    recompute: Sequence[RecomputeMode] = RECOMPUTE_MODES,
) -> list[Configuration]:
    """Every configuration to try: ``micro_batches`` (by default ``S``, ``2S`` and ``4S``; at most ``batch_size``,
    so each micro-batch has a sample), ``virtual_stages`` for the schedules that take several (by default 2 and 4
    for ``interleaved_1f1b``, 2 for ``zbv``; at most ``num_blocks`` chunks in all)."""
    counts = sorted({m for m in (micro_batches or (num_stages, 2 * num_stages, 4 * num_stages)) if m <= batch_size})
    if not counts:
        raise ValueError(
            f"a batch of {batch_size} samples cannot be split into {min(micro_batches or (num_stages,))} or more"
            " micro-batches; give a larger batch or smaller micro-batch counts."
        )
    found = []
    for name in schedules:
        schedule = SCHEDULES[name]
        if virtual_stages is not None:
            chunks = [v for v in virtual_stages if _allowed(schedule.min_virtual_stages, schedule.max_virtual_stages, v)]
        elif schedule.max_virtual_stages == 1:
            chunks = [1]
        else:
            chunks = [v for v in INTERLEAVED_VIRTUAL_STAGES if _allowed(schedule.min_virtual_stages, schedule.max_virtual_stages, v)]
        for v in chunks:
            if num_stages * v > num_blocks:
                continue
            found += [Configuration(name, m, v, mode) for m in counts for mode in recompute]
    return found


def runtime_costs(device_type: str) -> RuntimeCosts:
    """The runtime's own costs measured on devices of ``device_type`` (:data:`MEASURED_RUNTIME_COSTS`)."""
    return MEASURED_RUNTIME_COSTS.get(device_type, MEASURED_RUNTIME_COSTS["cpu"])


def _allowed(low: int, high: int | None, v: int) -> bool:
    return v >= low and (high is None or v <= high)


def plan_configuration(
    configuration: Configuration,
    model: CostModel,
    num_stages: int,
    batch_size: int,
    partition: Partition = lambda costs, parts: _even_split(len(costs), parts),
    runtime: RuntimeCosts = RuntimeCosts(),
) -> PlannedConfiguration:
    """The prediction for one configuration: the blocks split into ``S·v`` chunks by ``partition`` (of each block's
    forward plus backward time), each chunk's costs the sum of its blocks', the runtime adding ``runtime``'s costs
    (none by default: the ideal step)."""
    m, v = configuration.num_micro_batches, configuration.virtual_stages
    blocks = model.at(batch_size / m)
    schedule = SCHEDULES[configuration.schedule]
    ranges = partition([b.forward + b.input_gradient + b.weight_gradient for b in blocks], num_stages * v)
    chunks = chunk_costs(blocks, ranges)
    prediction = predict(
        schedule, num_stages, m, chunks, v, runtime.send_time, configuration.recompute, runtime.action_time
    )
    parameters = [0.0] * num_stages
    for k, r in enumerate(ranges):
        parameters[schedule.owner(k, num_stages)] += sum(blocks[i].parameter_bytes for i in r)
    memory = tuple(2 * p + a for p, a in zip(parameters, prediction.peak_activation_bytes))
    return PlannedConfiguration(
        configuration, prediction.step, prediction.bubble, prediction.peak_activation_bytes, memory,
        simulation=prediction.simulation,
    )


def chunk_costs(blocks: Sequence[BlockCosts], ranges: Sequence[range]) -> list[ComputeCosts]:
    """What each chunk (the blocks of each range) costs a micro-batch: the sums of its blocks' times and activation
    bytes, and its first block's input bytes (what a re-computed chunk keeps)."""
    return [
        ComputeCosts(
            sum(blocks[i].forward for i in r), sum(blocks[i].input_gradient for i in r),
            sum(blocks[i].weight_gradient for i in r), sum(blocks[i].activation_bytes for i in r),
            blocks[r[0]].input_bytes,
        )
        for r in ranges
    ]


def rank_configurations(
    model: CostModel,
    num_stages: int,
    batch_size: int,
    memory_budget: float | None = None,
    candidates: Sequence[Configuration] | None = None,
    partition: Partition = lambda costs, parts: _even_split(len(costs), parts),
    runtime: RuntimeCosts = RuntimeCosts(),
) -> list[PlannedConfiguration]:
    """Every candidate (by default :func:`configurations` of every schedule) predicted, fastest first; ``fits``
    says whether its most loaded stage stays within ``memory_budget`` bytes (``None``: no limit). Ties go to the
    less memory."""
    if candidates is None:
        candidates = configurations(num_stages, batch_size, model.num_blocks)
    rows = [plan_configuration(c, model, num_stages, batch_size, partition, runtime) for c in candidates]
    rows = [replace(r, fits=memory_budget is None or r.memory_bytes <= memory_budget) for r in rows]
    return sorted(rows, key=lambda r: (round(r.step, 9), r.memory_bytes))


def choose(rows: Sequence[PlannedConfiguration]) -> PlannedConfiguration:
    """The fastest configuration that fits; a ``ValueError`` naming the smallest need when none does."""
    fitting = [r for r in rows if r.fits]
    if fitting:
        return fitting[0]
    smallest = min(rows, key=lambda r: r.memory_bytes)
    raise ValueError(
        f"no schedule fits the memory budget: the least memory any of the {len(rows)} configurations needs is"
        f" {size_text(smallest.memory_bytes)} per stage ({smallest.configuration}); raise memory_budget, use more stages,"
        " or a smaller batch."
    )


def why(rows: Sequence[PlannedConfiguration], chosen: PlannedConfiguration) -> str:
    """Why ``chosen``: how much faster than the next fitting configuration and than the default (GPipe at 4S),
    which faster ones the budget excludes, and its memory."""
    fitting = [r for r in rows if r.fits and r is not chosen]
    lines = [f"{chosen.configuration}: predicted step {_seconds(chosen.step)}, bubble {chosen.bubble:.3f},"
             f" at most {size_text(chosen.memory_bytes)} per stage."]
    if fitting:
        nearest = fitting[0]
        lines.append(f"The next best, {nearest.configuration}, is {_slower(nearest.step, chosen.step)}.")
    defaults = [r for r in rows if r.configuration.schedule == "gpipe" and r.configuration.recompute == "except_last"]
    if defaults:
        default = max(defaults, key=lambda r: r.configuration.num_micro_batches)
        if default is not chosen:
            lines.append(f"GPipe as configured by default, {default.configuration}, is {_slower(default.step, chosen.step)}.")
    excluded = [r for r in rows if not r.fits and r.step < chosen.step]
    if excluded:
        lines.append(
            f"{len(excluded)} faster configuration{'s' if len(excluded) > 1 else ''} exceed the memory budget (the"
            f" fastest, {excluded[0].configuration}, needs {size_text(excluded[0].memory_bytes)} per stage)."
        )
    return " ".join(lines)


def plan_table(rows: Sequence[PlannedConfiguration], limit: int | None = None) -> str:
    """The ranked configurations as a text table: rank, schedule, M, v, checkpoint, predicted step, bubble, peak
    activations of each stage and the most memory any stage needs (``*``: over the budget)."""
    shown = list(rows)[:limit] if limit else list(rows)
    largest = max((a for r in shown for a in r.peak_activation_bytes), default=0.0)
    unit, scale = next(((u, f) for u, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if largest >= f), ("B", 1))
    header = ["#", "schedule", "M", "v", "checkpoint", "step", "bubble", f"peak activations per stage ({unit})", "memory"]
    body = [
        [
            str(i + 1), r.configuration.schedule, str(r.configuration.num_micro_batches),
            str(r.configuration.virtual_stages), r.configuration.recompute, _seconds(r.step), f"{r.bubble:.3f}",
            " ".join(f"{a / scale:.1f}" for a in r.peak_activation_bytes),
            size_text(r.memory_bytes) + ("" if r.fits else " *"),
        ]
        for i, r in enumerate(shown)
    ]
    widths = [max(len(row[c]) for row in [header, *body]) for c in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *body]]
    if len(shown) < len(rows):
        lines.append(f"... {len(rows) - len(shown)} more")
    return "\n".join(lines)


def _slower(step: float, best: float) -> str:
    return f"{(step / best - 1) * 100:.1f}% slower ({_seconds(step)})" if best > 0 else f"as fast ({_seconds(step)})"


def _seconds(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms" if seconds < 10 else f"{seconds:.2f} s"


def size_text(size: float) -> str:
    """Bytes as GiB, MiB, KiB or B."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{size:.0f} B"


def _even_split(num_blocks: int, parts: int) -> list[range]:
    """``num_blocks`` blocks in ``parts`` contiguous ranges whose sizes differ by at most one, the larger first: the
    default partition, as ``PipelineParallelConfig.split_into_stages`` splits (which sits above the schedules, in
    :mod:`lightning_pipe.partition.counts`)."""
    base, extra = divmod(num_blocks, parts)
    sizes = [base + 1 if part < extra else base for part in range(parts)]
    return [range(sum(sizes[:part]), sum(sizes[: part + 1])) for part in range(parts)]
