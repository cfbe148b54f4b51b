"""The stall watchdog's cost: steps with ``GPipeStrategy(stall_watchdog=True)`` (the default) against ``False``.

Two models, each with the watchdog on and off taking turns in one launch: the Lightning-overhead model (compute-bound,
2 stages: the fits of :mod:`ranks.overhead`, measured in the shared launch of :mod:`harness.measurements`) and the
soak model (``benchmarks/soak.py``: 4 stages of small layers, steps of about 100 ms that are almost all waits on
other ranks, so a cost per wait shows most there). The cost is the median over pairs of fits of the on / off ratio
of their step times; the load average beside it says how busy the machine was.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness.measurements import NUM_STAGES, measured
from harness.report import markdown_table, verdict
from harness.summarize import median, median_ratio
from harness.workload import workload

BENCHMARKS = Path(__file__).resolve().parents[1]
TARGET_COST = 0.01
SOAK = {"pairs": 8, "steps": 96, "stages": 4}  # fits of 6 epochs of 16 steps, the first epoch not measured
QUICK_SOAK = {"pairs": 1, "steps": 48, "stages": 2}


def run(quick: bool) -> dict[str, Any]:
    work = workload(quick)
    answers = measured("overhead", quick)
    overhead_model = _pairs(
        answers[0]["lightning_s"], answers[0]["lightning_unwatched_s"],
        _summed_over_ranks([a["lightning_cpu_s"] for a in answers]),
        _summed_over_ranks([a["lightning_unwatched_cpu_s"] for a in answers]),
    )
    soak = soak_comparison(QUICK_SOAK if quick else SOAK)
    models = {
        f"Lightning-overhead model: {work.depth} × Linear({work.width}, {work.width}), batch {work.batch},"
        f" {NUM_STAGES} stages, M = {answers[0]['micro_batches']}, {work.steps_per_fit}-step fits": overhead_model,
        f"soak model: {soak['stages']} stages, M = 8, {soak['steps']}-step fits": {
            "pairs": soak["pairs"], "on_s": median(soak["on_s"]), "off_s": median(soak["off_s"]), "cost": soak["cost"],
            "on_cpu_s": median(soak["on_cpu_s"]), "off_cpu_s": median(soak["off_cpu_s"]), "cpu_cost": soak["cpu_cost"],
        },
    }
    rows = [
        [name, m["pairs"], f"{1e3 * m['on_s']:.1f}", f"{1e3 * m['off_s']:.1f}", f"{m['cost']:+.2%}",
         f"{1e3 * m['on_cpu_s']:.1f}", f"{1e3 * m['off_cpu_s']:.1f}", f"{m['cpu_cost']:+.2%}"]
        for name, m in models.items()
    ]
    cpu_costs = [m["cpu_cost"] for m in models.values()]
    wall_costs = [m["cost"] for m in models.values()]
    load = ", ".join(f"{value:.2f}" for value in soak["load_average"])
    markdown = (
        "Each model trained with the stall watchdog on and off in turn, in one launch per model (the"
        " Lightning-overhead model: a fit of each per round, in alternating order, beside the plain loop of the"
        " Lightning overhead section, each fit's median step; the soak model: fits in the order on, off, off, on, ...,"
        " each fit's mean step within its epochs after the first). The cost is the median over the pairs of the"
        " on / off ratio, of the wall-clock step and of the CPU time all ranks' processes spent per step (every"
        " thread's, the watchdog's own thread included). On a machine shared with other work the wall-clock step"
        " varies by tens of percent from fit to fit; the CPU time the ranks spend is what the watchdog adds to, and"
        " varies far less, so the target is judged on it.\n\n"
        + markdown_table(
            ["model", "pairs", "on (ms/step)", "off (ms/step)", "wall-clock cost", "CPU on (ms/step)",
             "CPU off (ms/step)", "CPU cost"],
            rows,
        )
        + f"\n\nLoad average (1, 5, 15 min, as `uptime` shows it) at the end of the soak comparison: {load}.\n\n"
        + verdict(f"stall watchdog ≤ {TARGET_COST:.0%} of the step (CPU time)", max(cpu_costs) <= TARGET_COST,
                  " and ".join(f"{c:+.2%}" for c in cpu_costs) + " (wall-clock: "
                  + " and ".join(f"{c:+.2%}" for c in wall_costs) + ")")
    )
    data = {"overhead_model": overhead_model, "soak_model": soak, "target": TARGET_COST}
    return {"title": "Stall watchdog overhead", "markdown": markdown, "data": data}


def _pairs(on: list[list[float]], off: list[list[float]], on_cpu: list[list[float]], off_cpu: list[list[float]]) -> dict:
    """Per-round step times (wall-clock, and CPU summed over ranks) of the fits with the watchdog on and off."""
    return {
        "pairs": len(on),
        "on_s": median([t for steps in on for t in steps]), "off_s": median([t for steps in off for t in steps]),
        "cost": median_ratio([median(r) for r in on], [median(r) for r in off]) - 1,
        "on_cpu_s": median([t for steps in on_cpu for t in steps]),
        "off_cpu_s": median([t for steps in off_cpu for t in steps]),
        "cpu_cost": median_ratio([median(r) for r in on_cpu], [median(r) for r in off_cpu]) - 1,
    }


def _summed_over_ranks(per_rank: list[list[list[float]]]) -> list[list[float]]:
    """Every rank's CPU seconds per step interval (by round), added over the ranks."""
    return [[sum(steps) for steps in zip(*rounds)] for rounds in zip(*per_rank)]


def soak_comparison(sizes: dict[str, int]) -> dict[str, Any]:
    """``benchmarks/soak.py --compare-watchdog`` at ``sizes``; its JSON result."""
    with tempfile.TemporaryDirectory(prefix="lightning_pipe_watchdog_") as tmp:
        result = Path(tmp) / "result.json"
        command = [sys.executable, str(BENCHMARKS / "soak.py"), "--compare-watchdog", str(sizes["pairs"]),
                   "--steps", str(sizes["steps"]), "--stages", str(sizes["stages"]), "--json", str(result)]
        path = os.pathsep.join(filter(None, [str(BENCHMARKS.parent), os.environ.get("PYTHONPATH")]))
        finished = subprocess.run(command, cwd=tmp, env={**os.environ, "PYTHONPATH": path}, capture_output=True,
                                  text=True, timeout=3600)
        if finished.returncode != 0 or not result.exists():
            raise RuntimeError(f"soak.py --compare-watchdog failed ({finished.returncode}):\n{finished.stderr[-6000:]}")
        return json.loads(result.read_text())
