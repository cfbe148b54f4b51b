"""The Chrome trace format (JSON object format) of traced pipeline steps: one track per stage, one event per interval.

Open a trace in https://ui.perfetto.dev or ``chrome://tracing``; :mod:`lightning_pipe.trace.picture` draws it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from lightning_pipe.trace.timeline import BACKWARD, FORWARD, RECOMPUTE, SEND, WAIT, Interval

_LABELS = {FORWARD: "F", BACKWARD: "B", RECOMPUTE: "R", SEND: "send ", WAIT: "wait "}


@dataclass(frozen=True)
class TracedStep:
    """Every stage's intervals of one step (``stages[s]`` is stage ``s``), for the trace file."""

    step: int
    stages: list[list[Interval]]
    ranks: list[int]
    bubble_fraction: float
    ideal_bubble_fraction: float



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
    """Write the Chrome trace of ``steps`` to ``path``, replacing the file whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(chrome_trace(steps)))
    temporary.replace(path)  # readers never see a half-written file
