"""Two commits side by side: ``Trainer(strategy="gpipe")`` steps on the Lightning-overhead model, the two trees
taking turns in one run, so that the machine's drift falls on both alike.

Usage::

    python benchmarks/compare_trees.py 6534a2b            # that commit against this working tree, 4 rounds
    python benchmarks/compare_trees.py 6534a2b --rounds 6 --quick --steps 40   # the per-step overhead alone

Each round launches 2 ranks per tree (in alternating order), ``steps`` Trainer steps each; a run's step is the
median of rank 0's intervals, its CPU time the median over steps of both ranks' CPU time summed. The result is the
median over rounds of this tree's step over the other's. The other commit is checked out in a temporary git
worktree; only lightning_pipe's public API is used, so the same rank script measures both.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
from pathlib import Path

import ranks.trainer_step
from harness.launch import BENCHMARKS, REPO, launch
from harness.report import markdown_table
from harness.workload import workload

STEPS = 12


def run_tree(tree: Path, quick: bool, steps: int) -> dict[str, float]:
    """One launch on ``tree``: its median step (rank 0's wall clock) and the ranks' CPU time per step."""
    spec = {"workload": workload(quick).to_spec(), "steps": steps}
    answers = launch(ranks.trainer_step.measure, 2, spec, env={"PYTHONPATH": f"{BENCHMARKS}{os.pathsep}{tree}"})
    cpu = [sum(per_rank) for per_rank in zip(*(answer["cpu_s"] for answer in answers))]
    return {"wall_s": statistics.median(answers[0]["wall_s"]), "cpu_s": statistics.median(cpu)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", help="the commit to compare this working tree with")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: the per-step overhead alone")
    parser.add_argument("--steps", type=int, default=STEPS, help="Trainer steps per launch (the first not measured)")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="lightning_pipe_before_") as tmp:
        before = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(before), args.before], cwd=REPO, check=True,
                       capture_output=True)
        try:
            rows, ratios, cpu_ratios = [], [], []
            for round_index in range(args.rounds):
                order = ("before", "now") if round_index % 2 == 0 else ("now", "before")
                runs = {name: run_tree(before if name == "before" else REPO, args.quick, args.steps) for name in order}
                ratio = runs["now"]["wall_s"] / runs["before"]["wall_s"]
                cpu_ratio = runs["now"]["cpu_s"] / runs["before"]["cpu_s"]
                ratios.append(ratio)
                cpu_ratios.append(cpu_ratio)
                rows.append([
                    round_index + 1, " then ".join(order), f"{1e3 * runs['before']['wall_s']:.1f}",
                    f"{1e3 * runs['now']['wall_s']:.1f}", f"{ratio:.3f}", f"{cpu_ratio:.3f}",
                ])
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=REPO, check=False)
    rows.append(["median", "", "", "", f"{statistics.median(ratios):.3f}", f"{statistics.median(cpu_ratios):.3f}"])
    print(markdown_table(
        ["round", "order", f"{args.before} (ms/step)", "this tree (ms/step)", "step: now / before",
         "CPU per step: now / before"],
        rows,
    ))
    print(f"\nload average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
