"""How many micro-batches' activations a stage holds: all ``M`` under GPipe, at most ``S - stage`` under 1F1B.

Measured in real fits (``checkpoint="never"``): the tensors each stage's training steps saved for backward, alive
at once, at their peak. GPipe's first stage holds every micro-batch before its first backward, which gives the size
of one micro-batch's activations there; 1F1B's stage ``s`` must hold ``S - s`` of them, within 10%.
"""

from __future__ import annotations

import json

from functools import partial
from pathlib import Path

import pytest

from helpers.launch import launch, launches_started_with_first_test

MICRO_BATCHES = 8  # as tests/workers/activation_memory_worker.py


def launched(devices: int, tmp: Path):
    runs = [{"name": schedule, "schedule": schedule} for schedule in ("gpipe", "1f1b")]
    launch("activation_memory_worker.py", {"devices": devices, "out": str(tmp), "runs": runs}, tmp)
    found = {}
    for run in runs:
        for path in (tmp / run["name"]).glob("rank*.json"):
            result = json.loads(path.read_text())
            found[(run["name"], result["stage"])] = result["peak_bytes"]
    return devices, found


# Every launch of this file, started together with its first test.
launches = launches_started_with_first_test(
    ("peaks",), lambda tmp: {n: partial(launched, n, tmp.mktemp(f"activations{n}")) for n in (2, 4)}
)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}procs")
def peaks(request, launches):
    return launches[request.param].result()


def test_gpipe_holds_every_micro_batch_and_1f1b_at_most_s_minus_stage(peaks):
    num_stages, found = peaks
    for stage in range(num_stages):
        one_micro_batch = found[("gpipe", stage)] / MICRO_BATCHES
        held = found[("1f1b", stage)] / one_micro_batch
        assert held == pytest.approx(num_stages - stage, rel=0.1), f"stage {stage} held {held:.2f} micro-batches"
    # The unit is the same on every stage (equal blocks), and the measurement tells the schedules apart.
    assert len({found[("gpipe", stage)] for stage in range(num_stages)}) == 1
    assert found[("1f1b", 0)] < found[("gpipe", 0)]
