"""The benchmark command runs end to end at tiny sizes and writes every section (timings are not asserted)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers.launch import REPO, run_python


def test_quick_benchmarks_write_every_section(tmp_path):
    result = run_python(REPO / "benchmarks" / "run.py", "--quick", "--out", tmp_path, cwd=tmp_path, check=False)
    assert result.returncode == 0, f"benchmarks failed:\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
    report = json.loads((tmp_path / "benchmarks.json").read_text())
    markdown = (tmp_path / "benchmarks.md").read_text()
    modules = sorted(path.stem for path in (REPO / "benchmarks" / "sections").glob("bench_*.py"))
    assert sorted(section["module"] for section in report["sections"]) == modules
    assert markdown.startswith("# Benchmarks") and "python benchmarks/run.py --quick" in markdown
    for section in report["sections"]:
        assert "error" not in section["data"], section["data"].get("error")
        assert f"## {section['title']}" in markdown
    pipeline = next(s for s in report["sections"] if s["module"] == "bench_pipeline")["data"]
    assert [row["micro_batches"] for row in pipeline["rows"]] == [1, 2, 4]
    assert all(row["t_pipeline_s"] > 0 and row["efficiency"] > 0 for row in pipeline["rows"])
    memory = next(s for s in report["sections"] if s["module"] == "bench_memory")["data"]
    assert [stage["stage"] for stage in memory["stages"]] == [0, 1]
    for stage in memory["stages"]:
        assert stage["bound_bytes"] > 0 and all(stage[mode]["peak_bytes"] > 0 for mode in ("never", "always"))
    balance = next(s for s in report["sections"] if s["module"] == "bench_balance")["data"]
    assert balance["contention_factor"] > 0 and balance["speedup_without_contention"] > 0
    assert len(balance["round_contention_factors"]) == len(balance["per_round"]) == balance["rounds"]


@pytest.fixture
def benchmark_modules(monkeypatch):
    """``benchmarks/`` importable, as the runner has it; its modules forgotten afterwards."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    yield
    for name, module in list(sys.modules.items()):
        if Path(getattr(module, "__file__", None) or "/").is_relative_to(REPO / "benchmarks"):
            del sys.modules[name]


def test_speedup_without_contention_shrinks_only_the_overlapped_time(benchmark_modules):
    from sections.bench_balance import speedup_without_contention

    round_ = {"uniform": {"step_s": 0.360, "least_busy_s": 0.045}, "time": {"step_s": 0.280, "least_busy_s": 0.230}}
    # No contention (c = 1): the measured ratio.
    assert speedup_without_contention(round_, 1.0) == pytest.approx(0.360 / 0.280)
    # c = 1.5: each step loses a third of its least busy stage's time (the overlap runs 1.5 times faster).
    assert speedup_without_contention(round_, 1.5) == pytest.approx((0.360 - 0.015) / (0.280 - 0.230 / 3))
