"""Each rank holds only what its stage runs: a Llama-shaped model with Llama-3-8B's proportions (the embedding and
the head 13% of the parameters), built on the meta device, trained with Adam on 4 and 8 stages.

Per rank, after a training step: its parameters, their gradients and Adam's two moments, against the 1/S share of
the whole model's (``share``); and its peak resident set against that share plus the fixed footprint of a process
(a tiny model's run first, in the same processes; the peak mark reset before each run). The same rank script runs
on the tree before hold-by-use (``BEFORE``: every stage held the embedding and the head), in a git worktree, so the
two trees are measured the same way in one sitting. On this tree, two more runs: ``balance="parameters"`` (which
charges the embedding to the first stage and the head to the last) and the weights read from a file per stage
(``pretrained=``: the bytes each rank reads).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from typing import Any

from harness.launch import BENCHMARKS, REPO, launch
from harness.report import markdown_table, verdict
from ranks import holding

BEFORE = "c15f494"  # main before the modules outside the blocks were held by use
TARGET = 1.05
MIB = 2**20


def sizes(quick: bool) -> dict[str, Any]:
    if quick:
        return {"stage_counts": [2], "width": 64, "depth": 4, "batch": 4, "length": 16, "steps": 2, "micro_batches": 2}
    return {"stage_counts": [4, 8], "width": 256, "depth": 32, "batch": 8, "length": 32, "steps": 2, "micro_batches": 8}


def run(quick: bool) -> dict[str, Any]:
    spec = sizes(quick)
    tiny = {"name": "tiny", "width": 32, "depth": 8}
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="lightning_pipe_before_") as before:
        subprocess.run(["git", "worktree", "add", "--detach", before, BEFORE], cwd=REPO, check=True, capture_output=True)
        try:
            for stages in spec["stage_counts"]:
                runs = [tiny, {"name": "uniform"}, {"name": "parameters", "strategy": {"balance": "parameters"}},
                        {"name": "pretrained", "pretrained": tempfile.gettempdir()}]
                now = launch(holding.measure, stages, {**spec, "runs": runs}, timeout=1800)
                old = launch(holding.measure, stages, {**spec, "runs": runs[:2]}, timeout=1800,
                             env={"PYTHONPATH": f"{BENCHMARKS}{os.pathsep}{before}"})
                results[str(stages)] = {"now": now, "before": old}
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", before], cwd=REPO, capture_output=True)
    return report(spec, results)


def report(spec: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    rows, worst_held, worst_peak, balance_rows = [], 0.0, 0.0, []
    for stages, result in results.items():
        count = int(stages)
        for tree, name in (("before", "uniform"), ("now", "uniform"), ("now", "parameters")):
            for rank, answer in enumerate(result[tree]):
                run = answer[name]
                whole = run["whole"]["parameters"] * 4  # parameters, gradients, two Adam moments (float32)
                share = whole / count
                held = sum(run["parts"].values())
                fixed = answer["tiny"]["peak_bytes"]
                held_ratio, peak_ratio = held / share, run["peak_bytes"] / (share + fixed)
                if name == "parameters":
                    worst_held, worst_peak = max(worst_held, held_ratio), max(worst_peak, peak_ratio)
                read = answer.get("pretrained", {}).get("read_bytes") if name == "uniform" else None
                rows.append([count, tree, name, rank, run["stage"], _mib(held), _mib(share), f"{held_ratio:.2f}",
                             _mib(run["peak_bytes"]), _mib(share + fixed), f"{peak_ratio:.2f}",
                             f"{(run['peak_bytes'] - fixed) / share:.2f}", _mib(read) if read is not None else "-"])
        now = result["now"]
        spread = {}
        for name in ("uniform", "parameters"):
            peaks = [answer[name]["peak_bytes"] - answer["tiny"]["peak_bytes"] for answer in now]
            spread[name] = max(peaks) / max(1, min(peaks))
        balance_rows.append([count, " ".join(map(str, now[0]["uniform"]["blocks_per_stage"])), f"{spread['uniform']:.2f}",
                             " ".join(map(str, now[0]["parameters"]["blocks_per_stage"])), f"{spread['parameters']:.2f}"])
    first = next(iter(results.values()))["now"][0]["uniform"]["whole"]
    table = markdown_table(
        ["stages", "tree", "balance", "rank", "stage", "held (MiB)", "1/S share (MiB)", "held / share", "peak (MiB)",
         "share + fixed (MiB)", "peak / (share + fixed)", "(peak − fixed) / share", "read from the file (MiB)"], rows)
    balance = markdown_table(["stages", "blocks per stage, uniform", "largest / smallest peak over fixed",
                              "blocks per stage, balance='parameters'", "largest / smallest peak over fixed"],
                             balance_rows)
    markdown = (
        f"A Llama-shaped model (width {spec['width']}, {spec['depth']} blocks, the embedding and the head"
        f" {first['embedding_and_head'] / first['parameters']:.0%} of {first['parameters'] / MIB / 4:.1f} M parameters),"
        f" built in `configure_model()`, Adam, batch {spec['batch']} × {spec['length']} tokens, {spec['steps']} steps,"
        f" {spec['micro_batches']} micro-batches. Held: the rank's parameters, gradients and Adam moments after a step;"
        f" share: a 1/S part of the whole model's. `before` is {BEFORE} (every stage held the embedding and the head),"
        " measured the same way in the same sitting.\n\n"
        f"{table}\n\n"
        + verdict(f"with `balance='parameters'`, every rank holds at most {TARGET}× its 1/S share", worst_held <= TARGET,
                  f"{worst_held:.2f}× at worst")
        + "\n\n"
        + verdict(f"with `balance='parameters'`, every rank's peak at most {TARGET}× (share + fixed footprint)",
                  worst_peak <= TARGET, f"{worst_peak:.2f}× at worst")
        + "\n\nWith the even split (`uniform`), the first and last stages hold the embedding and the head on top of"
        " as many blocks as the others: the balance is what brings them to their share."
        + "\n\nThe balance: `balance='parameters'` charges the embedding to the first stage and the head to the last"
        " (a model built on the meta device has no weights to profile for `'memory'`), so those stages get fewer"
        f" blocks. The peaks above each rank's fixed footprint:\n\n{balance}"
    )
    data = {**spec, "results": results, "worst_held_ratio": worst_held, "worst_peak_ratio": worst_peak}
    return {"title": "Each rank holds only what its stage runs", "markdown": markdown, "data": data}


def _mib(count: float) -> str:
    return f"{count / MIB:.1f}"



