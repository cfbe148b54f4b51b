"""Timeline traces and the bubble metric: what the stages did, in GPipe order, on one clock."""

from __future__ import annotations

import csv
import json
from collections import defaultdict

import pytest

from helpers.launch import launch
from lightning_pipe.schedules.builtin import SCHEDULES
from lightning_pipe.schedules.simulator import clock_cycles, ideal_bubble
from lightning_pipe.trace import TracedStep, main, write_chrome_trace
from lightning_pipe.trace.timeline import BACKWARD, FORWARD, RECOMPUTE, Interval, bubble_fraction, stage_extent

# One host: every process reads one clock (only the microsecond rounding differs). Hosts apart: clocks aligned by
# ping-pong, off by at most half the shortest round trip.
ALIGNMENT_TOLERANCE_US = {"one host": 1.0, "host per rank": 2000.0}


def ideal_intervals(num_stages: int, num_micro_batches: int) -> list[list[Interval]]:
    """Each stage's forwards and backwards at the ticks of the ideal GPipe timeline, one second per tick."""
    simulation = clock_cycles(num_stages, num_micro_batches)
    return [
        [Interval(a.kind, a.micro_batch, float(start), float(end)) for start, end, a in stage]
        for stage in simulation.intervals
    ]


def ideal_bubble_fraction(num_stages: int, num_micro_batches: int) -> float:
    return ideal_bubble(SCHEDULES["gpipe"], num_stages, num_micro_batches, 1)


@pytest.mark.parametrize(("stages", "micro_batches"), [(2, 1), (2, 4), (3, 8), (4, 4)])
def test_bubble_of_the_ideal_timeline_is_the_formula(stages, micro_batches):
    extents = [stage_extent(intervals) for intervals in ideal_intervals(stages, micro_batches)]
    assert bubble_fraction(extents) == pytest.approx(ideal_bubble_fraction(stages, micro_batches))


def test_chrome_trace_holds_one_track_per_stage_with_micro_batch_events(tmp_path):
    stages = ideal_intervals(3, 4)
    step = TracedStep(7, stages, [2, 1, 0], 0.33, ideal_bubble_fraction(3, 4))
    write_chrome_trace(tmp_path / "trace.json", [step])
    trace = json.loads((tmp_path / "trace.json").read_text())
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert names == {0: "stage 0 (rank 2)", 1: "stage 1 (rank 1)", 2: "stage 2 (rank 0)", 3: "steps"}
    f2 = next(e for e in trace["traceEvents"] if e.get("name") == "F2" and e["tid"] == 1)
    assert f2["ph"] == "X" and f2["ts"] == pytest.approx(3e6) and f2["dur"] == pytest.approx(1e6)  # tick 3 of 12
    assert trace["otherData"]["steps"][0]["step"] == 7


GPIPE_RUNS = [
    {"name": "except_last", "num_micro_batches": 4, "checkpoint": "except_last", "trace_steps": [1, 2],
     "train_samples": 48, "csv_logger": True},
    {"name": "never", "num_micro_batches": 3, "checkpoint": "never", "trace_steps": [0], "train_samples": 16,
     "one_host_per_rank": True},
]
# Per-micro-batch schedules with 2 chunks per stage (6 chunks of the 8 layers), with their bubble formulas at S=3.
CHUNKED_RUNS = [
    {"name": "interleaved_1f1b", "num_micro_batches": 4, "checkpoint": "never", "trace_steps": [1],
     "train_samples": 32, "csv_logger": True, "strategy": {"schedule": "interleaved_1f1b"},
     "formula": 2 / (2 * 4 + 2)},  # (S-1)/(v·M+S-1)
    {"name": "zbv", "num_micro_batches": 6, "checkpoint": "never", "trace_steps": [0], "train_samples": 32,
     "csv_logger": True, "strategy": {"schedule": "zbv"}, "formula": 2 / (6 * 6 + 2)},  # (S-1)/(6M+S-1), M >= 2S-1
]
# 3 stages exercise the first, a middle and the last stage.
LAUNCH = {"devices": 3, "runs": GPIPE_RUNS + CHUNKED_RUNS}


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trace")
    result = launch("balance_trace_worker.py", {**LAUNCH, "out": str(tmp)}, tmp)
    (tmp / "output.txt").write_text(result.stdout + result.stderr)
    return tmp


def events_by_step_and_stage(trace: dict) -> dict[tuple[int, int], list[dict]]:
    grouped: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for event in trace["traceEvents"]:
        if event.get("ph") == "X" and "micro_batch" in event.get("args", {}):
            grouped[(event["args"]["step"], event["tid"])].append(event)
    return grouped


@pytest.mark.parametrize("run", GPIPE_RUNS, ids=lambda run: run["name"])
def test_trace_holds_every_forward_and_backward_in_gpipe_order(traced, run):
    trace = json.loads((traced / run["name"] / "gpipe_trace.json").read_text())
    grouped = events_by_step_and_stage(trace)
    m = run["num_micro_batches"]
    tolerance = ALIGNMENT_TOLERANCE_US["host per rank" if run.get("one_host_per_rank") else "one host"]
    assert {step for step, _ in grouped} == set(run["trace_steps"])
    for step in run["trace_steps"]:
        for stage in range(3):
            events = sorted(grouped[(step, stage)], key=lambda e: e["ts"])
            compute = [e["name"] for e in events if e["cat"] in (FORWARD, BACKWARD)]
            assert compute == [f"F{i}" for i in range(m)] + [f"B{i}" for i in reversed(range(m))], (step, stage)
            recomputed = sorted(e["args"]["micro_batch"] for e in events if e["cat"] == RECOMPUTE)
            assert recomputed == (list(range(m - 1)) if run["checkpoint"] == "except_last" else [])
            backward = {e["args"]["micro_batch"]: e for e in events if e["cat"] == BACKWARD}
            for e in (e for e in events if e["cat"] == RECOMPUTE):  # re-computation happens inside its backward
                outer = backward[e["args"]["micro_batch"]]
                assert outer["ts"] <= e["ts"] and e["ts"] + e["dur"] <= outer["ts"] + outer["dur"] + 1
        # One clock: a micro-batch's forward starts on a stage after it ended upstream; backwards flow back.
        for stage in range(1, 3):
            for i in range(m):
                up = next(e for e in grouped[(step, stage - 1)] if e["name"] == f"F{i}")
                down = next(e for e in grouped[(step, stage)] if e["name"] == f"F{i}")
                assert down["ts"] >= up["ts"] + up["dur"] - tolerance
                up_b = next(e for e in grouped[(step, stage - 1)] if e["name"] == f"B{i}")
                down_b = next(e for e in grouped[(step, stage)] if e["name"] == f"B{i}")
                assert up_b["ts"] >= down_b["ts"] + down_b["dur"] - tolerance
    for summary in trace["otherData"]["steps"]:
        assert summary["ideal_bubble_fraction"] == pytest.approx(2 / (m + 2))
        assert 0.0 < summary["bubble_fraction"] < 1.0


def test_bubble_fraction_reaches_the_loggers_every_step(traced):
    with open(traced / "except_last" / "csv" / "version_0" / "metrics.csv") as file:
        rows = [row for row in csv.DictReader(file) if row.get("pipeline/bubble_fraction")]
    assert len(rows) == 3  # 48 samples in batches of 16
    for row in rows:
        assert 0.0 < float(row["pipeline/bubble_fraction"]) < 1.0
        assert float(row["pipeline/ideal_bubble_fraction"]) == pytest.approx(2 / 6)
    results = [json.loads((traced / "except_last" / f"rank{r}.json").read_text()) for r in range(3)]
    assert results[0]["bubbles"] == results[1]["bubbles"] == results[2]["bubbles"]  # every stage agrees
    assert len(results[0]["bubbles"]) == 3


@pytest.mark.parametrize("run", CHUNKED_RUNS, ids=lambda run: run["name"])
def test_trace_of_a_chunked_schedule_names_every_stage_and_holds_its_actions_in_order(traced, run):
    """Each stage's forwards and backwards (two chunks each; ZB-V's backward in its input and weight halves) in the
    order of the schedule's actions; micro-batches flow down the stages on one clock."""
    trace = json.loads((traced / run["name"] / "gpipe_trace.json").read_text())
    ranks = trace["otherData"]["steps"][0]["ranks"]
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert names == {**{stage: f"stage {stage} (rank {ranks[stage]})" for stage in range(3)}, 3: "steps"}
    schedule, m = SCHEDULES[run["strategy"]["schedule"]], run["num_micro_batches"]
    grouped = events_by_step_and_stage(trace)
    assert {step for step, _ in grouped} == set(run["trace_steps"])
    for step in run["trace_steps"]:
        for stage in range(3):
            events = sorted(grouped[(step, stage)], key=lambda e: e["ts"])
            compute = [(e["cat"], e["args"]["micro_batch"]) for e in events if e["cat"] in (FORWARD, BACKWARD)]
            actions = schedule.stage_actions(stage, 3, m, 2, run["checkpoint"])
            assert compute == [(FORWARD if a.kind == "forward" else BACKWARD, a.micro_batch) for a in actions
                               if a.kind in ("forward", "backward", "backward_input", "backward_weight")], stage
        for stage in range(1, 3):  # chunk `stage` on stage `stage` in both placements: the first forward of each
            for i in range(m):
                up = next(e for e in sorted(grouped[(step, stage - 1)], key=lambda e: e["ts"]) if e["name"] == f"F{i}")
                down = next(e for e in sorted(grouped[(step, stage)], key=lambda e: e["ts"]) if e["name"] == f"F{i}")
                assert down["ts"] >= up["ts"] + up["dur"] - ALIGNMENT_TOLERANCE_US["one host"]


@pytest.mark.parametrize("run", CHUNKED_RUNS, ids=lambda run: run["name"])
def test_logged_ideal_bubble_is_the_schedules_formula_beside_the_measured_one(traced, run):
    schedule = SCHEDULES[run["strategy"]["schedule"]]
    assert ideal_bubble(schedule, 3, run["num_micro_batches"], 2) == pytest.approx(run["formula"])
    with open(traced / run["name"] / "csv" / "version_0" / "metrics.csv") as file:
        rows = [row for row in csv.DictReader(file) if row.get("pipeline/bubble_fraction")]
    assert len(rows) == run["train_samples"] // 16  # one per step
    for row in rows:
        assert float(row["pipeline/ideal_bubble_fraction"]) == pytest.approx(run["formula"])
        assert 0.0 < float(row["pipeline/bubble_fraction"]) < 1.0
    for summary in json.loads((traced / run["name"] / "gpipe_trace.json").read_text())["otherData"]["steps"]:
        assert summary["ideal_bubble_fraction"] == pytest.approx(run["formula"])


def test_every_trace_written_is_announced_once_with_its_absolute_path(traced):
    output = (traced / "output.txt").read_text()
    for run in LAUNCH["runs"]:
        path = (traced / run["name"] / "gpipe_trace.json").resolve()
        assert output.count(f"wrote the trace of step {run['trace_steps'][0]} to {path} ") == 1, output[-3000:]
        assert output.count(f"to {path} ") == 1  # once per file, though later steps rewrite it
        assert f"lightning-pipe trace render {path} timeline.png" in output


def test_render_draws_the_trace_as_a_png(traced, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "timeline.png"
    main(["render", str(traced / "except_last" / "gpipe_trace.json"), str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
