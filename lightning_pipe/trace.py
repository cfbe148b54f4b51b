"""Timeline traces of pipeline steps: gathered from every stage, written as Chrome trace JSON, rendered as a PNG.

``GPipeStrategy(trace_steps=[3, 4], trace_dir="traces")`` writes ``traces/gpipe_trace.json``: one track per stage,
with the forward, backward, re-computation, send and wait intervals of the chosen steps on one clock. Open it in
https://ui.perfetto.dev or ``chrome://tracing``, or draw it::

    python -m lightning_pipe.trace render traces/gpipe_trace.json timeline.png   # needs matplotlib (the plot extra)

Clocks: every rank measures time on the clock of the pipeline group's first rank (:func:`align_clocks`): exactly on
one host, where processes share one monotonic clock, and to within half a network round trip across hosts.
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_pipe.schedule import ideal_bubble_fraction
from lightning_pipe.timeline import (
    BACKWARD,
    FORWARD,
    KINDS,
    RECOMPUTE,
    SEND,
    WAIT,
    Interval,
    StageExtent,
    StepTimeline,
    bubble_fraction,
    stage_extent,
)

TRACE_FILE_NAME = "gpipe_trace.json"
_LABELS = {FORWARD: "F", BACKWARD: "B", RECOMPUTE: "R", SEND: "send ", WAIT: "wait "}


def align_clocks(group: dist.ProcessGroup | None, rounds: int = 8) -> float:
    """What this rank subtracts from its ``time.perf_counter()`` to read the clock every rank of ``group`` shares.

    The shared clock is the group's first rank's, started at a broadcast. Processes on one host read one monotonic
    clock, so there nothing is estimated and traces line up exactly. A rank on another host estimates its offset
    from the first rank's clock NTP-style: ``rounds`` ping-pongs, keeping the one with the shortest round trip,
    whose midpoint is off by at most half that round trip.
    """
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    reference, me = ranks[0], dist.get_rank()
    hosts: list[Any] = [None] * len(ranks)
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    offset = 0.0  # the reference's clock minus this rank's clock
    for peer, host in zip(ranks[1:], hosts[1:]):
        if host == hosts[0] or me not in (reference, peer):
            continue
        best_round_trip = math.inf
        for _ in range(rounds):
            stamp = torch.zeros(1, dtype=torch.float64)
            if me == peer:
                sent = time.perf_counter()
                dist.send(stamp, reference, group=group)
                dist.recv(stamp, reference, group=group)
                received = time.perf_counter()
                if received - sent < best_round_trip:
                    best_round_trip, offset = received - sent, float(stamp) - (sent + received) / 2
            else:
                dist.recv(stamp, peer, group=group)
                stamp[0] = time.perf_counter()
                dist.send(stamp, peer, group=group)
    origin = torch.tensor([time.perf_counter()], dtype=torch.float64)
    dist.broadcast(origin, reference, group=group)
    return float(origin) - offset


@dataclass(frozen=True)
class StepObservation:
    """What the pipeline learned about one training step, the same on every stage."""

    step: int
    bubble_fraction: float
    ideal_bubble_fraction: float
    busy_seconds: list[float]  # per stage, in stage order: time spent in forwards and backwards


@dataclass(frozen=True)
class TracedStep:
    """Every stage's intervals of one step (``stages[s]`` is stage ``s``), for the trace file."""

    step: int
    stages: list[list[Interval]]
    ranks: list[int]
    bubble_fraction: float
    ideal_bubble_fraction: float


class PipelineTracer:
    """Gathers each step's timeline from the stages of one pipeline; the bubble metric, and the trace file.

    Every stage calls :meth:`observe` after its backward (a collective over the pipeline's CPU group). The rank that
    ``writes`` keeps the traced steps and rewrites the trace file after each, so that it exists even if training
    stops early.
    """

    def __init__(
        self,
        timeline: StepTimeline,
        group: dist.ProcessGroup | None,
        stage: int,
        num_stages: int,
        rank: int,
        trace_steps: Sequence[int] = (),
        trace_path: Path | None = None,
        writes: bool = False,
    ) -> None:
        self.timeline = timeline
        self.group = group
        self.stage = stage
        self.num_stages = num_stages
        self.rank = rank
        self.trace_steps = frozenset(trace_steps)
        self.trace_path = trace_path
        self.writes = writes and trace_path is not None
        self.traced: list[TracedStep] = []
        self.timeline.offset = align_clocks(group)

    def observe(self, step: int) -> StepObservation | None:
        """The bubble of the step that just ended (``None`` if no stage computed), tracing it if asked to."""
        intervals = self.timeline.intervals()
        extent = stage_extent(intervals)
        num_micro_batches = len({i.micro_batch for i in intervals if i.kind == FORWARD})
        local = [float(self.stage), float(num_micro_batches), *(extent.as_list() if extent else [math.nan] * 3)]
        gathered = [torch.empty(5, dtype=torch.float64) for _ in range(self.num_stages)]
        dist.all_gather(gathered, torch.tensor(local, dtype=torch.float64), group=self.group)
        rows = sorted(tensor.tolist() for tensor in gathered)
        extents = [StageExtent(*row[2:]) for row in rows if not math.isnan(row[2])]
        observation = None
        if extents:
            m = int(max(row[1] for row in rows))
            observation = StepObservation(
                step,
                bubble_fraction(extents),
                ideal_bubble_fraction(self.num_stages, max(m, 1)),
                [0.0 if math.isnan(row[4]) else row[4] for row in rows],
            )
        if step in self.trace_steps and observation is not None:
            self._trace(step, intervals, observation)
        return observation

    def _trace(self, step: int, intervals: list[Interval], observation: StepObservation) -> None:
        holder: list[Any] = [None] * self.num_stages
        dist.all_gather_object(holder, (self.stage, self.rank, intervals), group=self.group)
        if not self.writes:
            return
        by_stage = sorted(holder, key=lambda item: item[0])
        self.traced.append(
            TracedStep(
                step,
                [item[2] for item in by_stage],
                [item[1] for item in by_stage],
                observation.bubble_fraction,
                observation.ideal_bubble_fraction,
            )
        )
        assert self.trace_path is not None
        write_chrome_trace(self.trace_path, self.traced)


# ---- the trace file ----------------------------------------------------------------------------------------------


def chrome_trace(steps: Sequence[TracedStep]) -> dict[str, Any]:
    """The Chrome trace (JSON object format) of ``steps``: one process, one thread (track) per stage.

    Times are microseconds from the first traced interval. A "steps" track above the stages spans each step's
    compute window and carries its bubble fraction.
    """
    starts = [i.start for step in steps for stage in step.stages for i in stage]
    origin = min(starts) if starts else 0.0
    num_stages = max((len(step.stages) for step in steps), default=0)
    ranks = steps[0].ranks if steps else []
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "GPipe pipeline"}},
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": num_stages, "args": {"name": "steps"}},
        {"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": num_stages, "args": {"sort_index": -1}},
    ]
    for stage in range(num_stages):
        name = f"stage {stage} (rank {ranks[stage]})"
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": stage, "args": {"name": name}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": stage, "args": {"sort_index": stage}})

    def micros(seconds: float) -> float:
        return round((seconds - origin) * 1e6, 3)

    for step in steps:
        compute = [i for stage in step.stages for i in stage if i.kind in (FORWARD, BACKWARD)]
        if compute:
            begin, end = min(i.start for i in compute), max(i.end for i in compute)
            events.append(
                {
                    "ph": "X", "name": f"step {step.step}", "cat": "step", "pid": 0, "tid": num_stages,
                    "ts": micros(begin), "dur": round((end - begin) * 1e6, 3),
                    "args": {
                        "bubble_fraction": step.bubble_fraction,
                        "ideal_bubble_fraction": step.ideal_bubble_fraction,
                    },
                }
            )
        for stage, intervals in enumerate(step.stages):
            for interval in intervals:
                events.append(
                    {
                        "ph": "X",
                        "name": f"{_LABELS[interval.kind]}{interval.micro_batch}",
                        "cat": interval.kind,
                        "pid": 0,
                        "tid": stage,
                        "ts": micros(interval.start),
                        "dur": round(interval.duration * 1e6, 3),
                        "args": {"step": step.step, "micro_batch": interval.micro_batch, "rank": step.ranks[stage]},
                    }
                )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "num_stages": num_stages,
            "steps": [
                {key: value for key, value in asdict(step).items() if key not in ("stages",)} for step in steps
            ],
        },
    }


def write_chrome_trace(path: Path, steps: Sequence[TracedStep]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(chrome_trace(steps)))
    temporary.replace(path)  # readers never see a half-written file


# ---- the picture -------------------------------------------------------------------------------------------------

_COLORS = {FORWARD: "#4C78A8", BACKWARD: "#F58518", RECOMPUTE: "#FFD8A8", SEND: "#222222", WAIT: "#E4E4E4"}


def render_png(trace: dict[str, Any], out: Path, title: str | None = None) -> None:
    """Draw a Chrome trace written by :func:`write_chrome_trace` as a Gantt chart, one row per stage."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as error:
        raise ImportError(
            "rendering a trace needs matplotlib; install it with `pip install lightning-pipe[plot]`"
            " (or `pip install matplotlib`)."
        ) from error

    intervals = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in KINDS]
    if not intervals:
        raise ValueError("the trace holds no pipeline intervals; was it written by GPipeStrategy(trace_steps=...)?")
    num_stages = 1 + max(e["tid"] for e in intervals)
    figure, axes = plt.subplots(figsize=(12, 0.8 + 0.7 * num_stages))
    # Drawing order: waits at the back, recomputation over its backward, sends on top.
    layers = {WAIT: (0.15, 0.7), FORWARD: (0.15, 0.7), BACKWARD: (0.15, 0.7), RECOMPUTE: (0.3, 0.4), SEND: (0.05, 0.1)}
    for kind, (offset, height) in layers.items():
        for event in (e for e in intervals if e["cat"] == kind):
            row = num_stages - 1 - event["tid"] + offset  # stage 0 on top
            start, width = event["ts"] / 1e3, max(event["dur"] / 1e3, 1e-3)
            axes.broken_barh(
                [(start, width)], (row, height), facecolors=_COLORS[kind], edgecolors="white", linewidth=0.3
            )
            if kind in (FORWARD, BACKWARD):
                axes.text(start + width / 2, row + height / 2, str(event["args"]["micro_batch"]), ha="center",
                          va="center", fontsize=7, color="white", clip_on=True)
    names = {
        e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("ph") == "M" and e["name"] == "thread_name"
    }
    axes.set_yticks([num_stages - 1 - s + 0.5 for s in range(num_stages)])
    axes.set_yticklabels([names.get(s, f"stage {s}") for s in range(num_stages)])
    axes.set_ylim(0, num_stages)
    axes.set_xlabel("time (ms)")
    steps = trace.get("otherData", {}).get("steps", [])
    if title is None:
        title = "GPipe timeline"
        if steps:
            title += "; " + ", ".join(
                f"step {s['step']}: bubble {s['bubble_fraction']:.2f} (ideal {s['ideal_bubble_fraction']:.2f})"
                for s in steps
            )
    axes.set_title(title, fontsize=10)
    figure.legend(
        handles=[Patch(color=_COLORS[k], label=k) for k in (FORWARD, BACKWARD, RECOMPUTE, SEND, WAIT)],
        loc="lower center", ncol=5, fontsize=8, frameon=False,
    )
    axes.grid(axis="x", alpha=0.3)
    figure.tight_layout(rect=(0, 0.1 + 0.1 / num_stages, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=150)
    plt.close(figure)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lightning_pipe.trace", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    render = commands.add_parser("render", help="draw a trace file as a PNG Gantt chart")
    render.add_argument("trace", type=Path, help="a Chrome trace JSON written by GPipeStrategy(trace_steps=...)")
    render.add_argument("out", type=Path, help="the PNG to write")
    render.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    render_png(json.loads(args.trace.read_text()), args.out, args.title)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
