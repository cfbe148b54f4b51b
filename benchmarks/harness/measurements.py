"""The measurements behind the pipeline, peer, overhead and memory sections: one launch, shared by all four.

One pair of processes measures everything in turn (speed, memory, then Lightning's overhead), which keeps the ratios
honest on a shared machine and pays the processes' start-up (importing Lightning takes seconds) once. The runner
imports every section in one Python, so they all read this one measurement. A part that fails is reported by its
own section; the others still get their numbers.
"""

from __future__ import annotations

import os
from functools import cache
from typing import Any

import ranks.speed
import ranks.suite
from harness.launch import launch
from harness.workload import workload

NUM_STAGES = 2
PARTS = ("speed", "memory", "overhead")
# The speed sections also measure this many stages where the machine has a core for each (one thread per stage).
MORE_STAGES = 4


@cache
def _all_ranks(quick: bool) -> list[dict[str, Any]]:
    return launch(ranks.suite.measure, NUM_STAGES, {"workload": workload(quick).to_spec(), "parts": PARTS})


def measured(part: str, quick: bool) -> list[dict[str, Any]]:
    """Every rank's answer for ``part`` (one of :data:`PARTS`), ordered by rank; raises if that part failed."""
    skipped = {"error": f"not measured: a part before {part!r} failed (see its section)"}
    answers = [answer.get(part, skipped) for answer in _all_ranks(quick)]
    errors = [answer["error"] for answer in answers if "error" in answer]
    if errors:
        raise RuntimeError(f"the {part} measurement failed:\n{errors[0]}")
    return answers


def stage_counts() -> tuple[int, ...]:
    """The stage counts the speed sections report: always :data:`NUM_STAGES`, more where the cores allow."""
    return (NUM_STAGES, MORE_STAGES) if (os.cpu_count() or 1) >= MORE_STAGES else (NUM_STAGES,)


@cache
def speed(num_stages: int, quick: bool) -> dict[str, list[float]]:
    """Step times per round of the speed measurement with ``num_stages`` processes (see :mod:`ranks.speed`)."""
    if num_stages == NUM_STAGES:
        return measured("speed", quick)[0]
    return launch(ranks.speed.measure, num_stages, {"workload": workload(quick).to_spec()})[0]
