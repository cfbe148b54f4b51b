"""The benchmark command runs end to end at tiny sizes and writes every section (timings are not asserted)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from helpers.launch import REPO, run_python


@pytest.mark.slow  # every section at tiny sizes (~100 s); run before recording benchmarks, which run them all anyway
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
    emulated = next(s for s in report["sections"] if s["module"] == "bench_emulated")["data"]
    assert {row["schedule"] for row in emulated["rows"]} >= {"gpipe", "gpipe_split", "zbv", "interleaved_1f1b_v4"}
    assert all(row["t_ours_s"] > row["t_ideal_s"] > 0 for row in emulated["rows"])
    accuracy = next(s for s in report["sections"] if s["module"] == "bench_accuracy")["data"]
    assert all(row["t_predicted_s"] >= row["t_ideal_s"] > 0 and row["t_measured_s"] > 0 for row in accuracy["rows"])
    assert all(row["peak_measured_bytes"] > 0 for row in accuracy["rows"]) and accuracy["choices"]
    gpt2 = next(s for s in report["sections"] if s["module"] == "bench_gpt2")["data"]
    assert gpt2["t_pipeline_s"] > 0 and gpt2["efficiency"] > 0 and gpt2["parameters"] > 0


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


def test_a_section_re_measured_alone_keeps_the_others_with_their_dates(benchmark_modules, tmp_path):
    import run

    old = {"date": "2026-11-29 22:19 UTC", "load_average_before": 0.5, "load_average_after": 2.5}
    machine = {"cpu": "cpu", "cores": 2, "platform": "linux", "torch": "2.13", "lightning": "2.6", "python": "3.11",
               "run_seconds": 9, **old}
    section = {"title": "Kept", "markdown": "kept text", "data": {}, "module": "bench_bubble", "seconds": 1.0}
    (tmp_path / "benchmarks.json").write_text(json.dumps({"quick": False, "machine": machine, "sections": [section]}))
    kept = run._last_results(tmp_path / "benchmarks.json", quick=False)
    assert kept["bench_bubble"]["date"] == old["date"] and kept["bench_bubble"]["load_average"] == [0.5, 2.5]
    with pytest.raises(SystemExit, match="would mix sizes"):
        run._last_results(tmp_path / "benchmarks.json", quick=True)
    fresh = {**section, "title": "Fresh", "module": "bench_memory_setup", "date": "2026-12-01 05:00 UTC",
             "load_average": [0.1, 1.2]}
    report = {"command": "python benchmarks/run.py --only bench_memory_setup", "quick": False,
              "machine": {**machine, "date": "2026-12-01 05:00 UTC"}, "only": ["bench_memory_setup"],
              "sections": [kept["bench_bubble"], fresh]}
    page = run.render(report)
    assert "to re-measure bench_memory_setup; the other sections are kept" in page
    assert "measured 2026-11-29 22:19 UTC, load average 0.5 before, 2.5 after" in page
    assert "measured 2026-12-01 05:00 UTC, load average 0.1 before, 1.2 after" in page



def test_gpu_check_cpu_path_reports_every_check_ok(tmp_path):
    """``benchmarks/gpu_check.py --device cpu``, the script to run the day a GPU is lent: every check a CPU can run
    holds (one stage in each precision, two gloo stages against one device, the trace); NCCL alone is not run."""
    result = run_python(REPO / "benchmarks" / "gpu_check.py", "--device", "cpu", "--out", tmp_path, cwd=tmp_path,
                        check=False, timeout=400)
    assert result.returncode == 0, f"{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    summary = (tmp_path / "summary.txt").read_text()
    verdicts = dict(re.findall(r"^(\S.*?)\s{2,}(ok|FAILED|not run|measured)\s{2,}", summary, re.M))
    precisions = ("32-true", "bf16-mixed", "16-mixed", "16-mixed-overflow")
    expected = {f"one stage, {p}": "ok" for p in precisions}
    expected |= {f"two stages on one device, gloo, {p}": "ok" for p in precisions}
    expected |= {"trace, two stages, gloo": "ok", "two stages on one device, nccl": "not run",
                 "engine overhead (one stage)": "measured"}
    assert verdicts == expected, summary


def test_the_emulated_sections_ideal_step_is_the_tick_table_of_its_costs(benchmark_modules):
    """GPipe at 4 stages and 8 micro-batches, 16 ms per stage for each of F, I, W: (M + S - 1) x (F + I + W); the last
    stage twice as heavy makes every micro-batch pass at its pace; deferred weight gradients shorten the drain."""
    from sections.bench_emulated import ideal

    assert ideal("gpipe", "uniform", 4, 8, 0.016) == pytest.approx((11 * 0.048, 8))
    assert ideal("gpipe", "heavy_last", 4, 8, 0.016)[0] == pytest.approx(3 * 0.016 + 8 * 0.096 + 3 * 0.032)
    assert ideal("gpipe_split", "uniform", 4, 8, 0.016)[0] < ideal("gpipe", "uniform", 4, 8, 0.016)[0]
    step, held = ideal("1f1b", "uniform", 4, 8, 0.016)
    assert step == pytest.approx(11 * 0.048) and held == 4  # 1F1B: GPipe's step, S micro-batches held, not M


def test_the_holding_sections_most_even_split_is_the_best_of_every_split(benchmark_modules):
    """The per-stage and per-block costs come back from peaks made with them, and the most even split found from the
    ends' counts is the most even of every composition of the blocks (brute force), the ends heavier than a block."""
    import itertools

    from sections.bench_holding import best_peak_spread, peak_costs

    costs = {"per_stage": 3.0, "per_block": 10.0, "first": 25.0, "last": 31.0}

    def peaks_of(blocks):
        peaks = [costs["per_stage"] + costs["per_block"] * b for b in blocks]
        peaks[0] += costs["first"]
        peaks[-1] += costs["last"]
        return peaks

    def answers(blocks):
        return [{"tiny": {"peak_bytes": 100},
                 "run": {"blocks_per_stage": blocks, "stage": stage, "peak_bytes": 100 + peak}}
                for stage, peak in enumerate(peaks_of(blocks))]

    runs = [answers([4, 4, 4, 4]), answers([2, 6, 5, 3])]
    fitted = peak_costs([{**a, "other": b["run"]} for a, b in zip(*runs)], ("run", "other"))
    assert fitted == pytest.approx(costs)
    spread, blocks, lowest_top = best_peak_spread(costs, 16, 4)
    every_split = [peaks_of([b - a for a, b in zip((0, *cut), (*cut, 16))])
                   for cut in itertools.combinations(range(1, 16), 3)]
    assert spread == pytest.approx(min(max(p) / min(p) for p in every_split))
    assert sum(blocks) == 16 and blocks[0] < blocks[1]
    assert lowest_top == pytest.approx(min(max(p) for p in every_split))


def test_cpu_spread_prints_a_ratio_per_launch(tmp_path):
    """``benchmarks/cpu_spread.py`` (the launches behind the CPU figures of benchmarks/optimisations.md) at one launch,
    no wait, two rounds: a row with both runtimes' CPU and their ratios."""
    result = run_python(REPO / "benchmarks" / "cpu_spread.py", "--launches", "1", "--stage-times", "0", "--rounds", "2",
                        cwd=tmp_path, check=False, timeout=300)
    assert result.returncode == 0, f"{result.stdout[-4000:]}\n{result.stderr[-6000:]}"
    rows = re.findall(r"^\| 1 \| 0 \| ([\d.]+) / ([\d.]+) \| ([\d.]+) \| ([\d.]+) / ([\d.]+) \| ([\d.]+) \|$", result.stdout, re.M)
    assert len(rows) == 1, result.stdout
    ours, peer, ratio, ours_main, peer_main, ratio_main = map(float, rows[0])
    assert ours > 0 and peer > 0 and ours_main > 0 and peer_main > 0
    assert ratio == pytest.approx(ours / peer, abs=0.02) and ratio_main == pytest.approx(ours_main / peer_main, abs=0.02)
