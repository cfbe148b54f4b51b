"""The benchmark command runs end to end at tiny sizes and writes every section (timings are not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_quick_benchmarks_write_every_section(tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "run.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert result.returncode == 0, f"benchmarks failed:\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
    report = json.loads((tmp_path / "benchmarks.json").read_text())
    markdown = (tmp_path / "benchmarks.md").read_text()
    modules = sorted(path.stem for path in (REPO / "benchmarks").glob("bench_*.py"))
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
