"""Each rank holds only what its stage runs: a Llama-shaped model with Llama-3-8B's proportions (the embedding and
the head 13% of the parameters), built on the meta device, trained with Adam on 4 and 8 stages.

Per rank, after a training step: its parameters, their gradients and Adam's two moments, against the 1/S share of
the whole model's (``share``); and its peak resident set against that share plus the fixed footprint of a process
(a tiny model's run first, in the same processes; the peak mark reset before each run). The same rank script runs
on the tree before hold-by-use (``BEFORE``: every stage held the embedding and the head), in a git worktree, so the
two trees are measured the same way in one sitting. On this tree, three more runs: ``balance="parameters"`` (which
charges the embedding to the first stage and the head to the last), ``balance="memory"`` (estimated on the meta device:
parameters, gradients, Adam's moments and the activations the training step saves, the logits on the last stage) and
the weights read from a file per stage (``pretrained=``: the bytes each rank reads).

Beside the measured ratios, the best any contiguous split of these blocks can reach (:func:`best_held_ratio`, an exact
search over the real per-block and outside parameter counts): whether a target is reachable at all with this model's
blocks, and whether the balance found that optimum.
"""

from __future__ import annotations

import math
import os
import subprocess
from collections.abc import Sequence
import tempfile
from typing import Any

import torch

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
                        {"name": "memory", "strategy": {"balance": "memory"}},
                        {"name": "pretrained", "pretrained": tempfile.gettempdir()}]
                now = launch(holding.measure, stages, {**spec, "runs": runs}, timeout=1800)
                old = launch(holding.measure, stages, {**spec, "runs": runs[:2]}, timeout=1800,
                             env={"PYTHONPATH": f"{BENCHMARKS}{os.pathsep}{before}"})
                results[str(stages)] = {"now": now, "before": old}
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", before], cwd=REPO, capture_output=True)
    return report(spec, results)


def report(spec: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    rows, worst_held, worst_peak, balance_rows, memory_holds, optimum_rows = [], 0.0, 0.0, [], [], []
    worst_by: dict[tuple[int, str], float] = {}  # (stages, balance): the largest held / share over the ranks
    costs = block_parameter_counts(spec["width"], spec["depth"])
    balanced = [name for name in ("parameters", "memory") if name in next(iter(results.values()))["now"][0]]
    for stages, result in results.items():
        count = int(stages)
        for tree, name in (("before", "uniform"), ("now", "uniform"), *(("now", name) for name in balanced)):
            for rank, answer in enumerate(result[tree]):
                run = answer[name]
                whole = run["whole"]["parameters"] * 4  # parameters, gradients, two Adam moments (float32)
                share = whole / count
                held = sum(run["parts"].values())
                fixed = answer["tiny"]["peak_bytes"]
                held_ratio, peak_ratio = held / share, run["peak_bytes"] / (share + fixed)
                if tree == "now":
                    worst_by[count, name] = max(worst_by.get((count, name), 0.0), held_ratio)
                if name == "parameters":
                    worst_held, worst_peak = max(worst_held, held_ratio), max(worst_peak, peak_ratio)
                read = answer.get("pretrained", {}).get("read_bytes") if name == "uniform" else None
                rows.append([count, tree, name, rank, run["stage"], _mib(held), _mib(share), f"{held_ratio:.2f}",
                             _mib(run["peak_bytes"]), _mib(share + fixed), f"{peak_ratio:.2f}",
                             f"{(run['peak_bytes'] - fixed) / share:.2f}", _mib(read) if read is not None else "-"])
        now = result["now"]
        row = [count]
        for name in ("uniform", *balanced):
            peaks = [answer[name]["peak_bytes"] - answer["tiny"]["peak_bytes"] for answer in now]
            blocks = now[0][name]["blocks_per_stage"]
            row += [" ".join(map(str, blocks)), f"{max(peaks) / max(1, min(peaks)):.2f}"]
            if name == "memory":
                fewer = max(blocks[0], blocks[-1]) < sum(blocks) / len(blocks)  # than a stage's mean
                memory_holds.append((count, fewer, max(peaks) / max(1, min(peaks))))
        balance_rows.append(row)
        split = now[0]["parameters"]["blocks_per_stage"] if "parameters" in balanced else None
        optimum_rows.append([count, f"{best_held_ratio(costs, count):.3f}", f"{best_held_spread(costs, count):.2f}",
                             f"{split_held_ratio(costs, split):.3f}" if split else "-",
                             f"{worst_by[count, 'parameters']:.3f}" if split else "-"])
    first = next(iter(results.values()))["now"][0]["uniform"]["whole"]
    table = markdown_table(
        ["stages", "tree", "balance", "rank", "stage", "held (MiB)", "1/S share (MiB)", "held / share", "peak (MiB)",
         "share + fixed (MiB)", "peak / (share + fixed)", "(peak − fixed) / share", "read from the file (MiB)"], rows)
    headers = ["stages"]
    for name in ("uniform", *balanced):
        headers += [f"blocks per stage, {name if name == 'uniform' else f'balance={name!r}'}",
                    "largest / smallest peak over fixed"]
    balance = markdown_table(headers, balance_rows)
    optimum = markdown_table(["stages", "best any contiguous split can hold (max held / share)",
                              "best largest / smallest held of any split",
                              "the split balance='parameters' chose, counted", "measured held / share at worst"],
                             optimum_rows)
    memory_verdicts = "".join(
        "\n\n" + verdict(f"at {count} stages, `balance='memory'` gives the first and last stages fewer blocks and the"
                          " peaks over the fixed footprint within 10% of each other", fewer and spread <= 1.10,
                          f"{'fewer' if fewer else 'not fewer'} blocks at the ends, largest / smallest {spread:.2f}")
        for count, fewer, spread in memory_holds
    )
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
        + "\n\nHow close any split can come: the blocks are whole, so a stage holds its share only as nearly as whole"
        " blocks add up to it. An exact search over every contiguous split of the real per-block parameter counts (the"
        " embedding on the first block's stage, the norm and the head on the last's) gives the smallest largest stage"
        f" there is:\n\n{optimum}\n\nWhere the best split is above {TARGET}×, no balance reaches the target with this"
        " model's blocks; where the chosen split's count equals the best, the balance found the optimum. The held bytes'"
        " largest over smallest stage is as even as whole blocks allow before activations are counted: where it is"
        " well above 1.10, the peaks (whose activations grow with the blocks held) do not come within 10% of each"
        " other under any split either."
        + "\n\nThe balance: `balance='parameters'` charges the embedding to the first stage and the head to the last;"
        " `balance='memory'`, on this model built on the meta device, estimates each block's parameters, gradients,"
        " Adam moments and saved activations there (the logits on the last stage), so those stages get fewer blocks."
        f" The peaks above each rank's fixed footprint:\n\n{balance}"
        + memory_verdicts
    )
    data = {**spec, "results": results, "worst_held_ratio": worst_held, "worst_peak_ratio": worst_peak,
            "block_parameter_counts": costs}
    return {"title": "Each rank holds only what its stage runs", "markdown": markdown, "data": data}


def block_parameter_counts(width: int, depth: int) -> list[int]:
    """Each block's parameter count, the embedding's added to the first block and the norm's and head's to the last
    (where the stages holding them are), counted on the meta device."""
    model = holding.LlamaShaped(width, depth)
    with torch.device("meta"):
        model.configure_model()
    counts = [sum(p.numel() for p in block.parameters()) for block in model.layers]
    counts[0] += sum(p.numel() for p in model.embed.parameters())  # type: ignore[union-attr]
    counts[-1] += sum(p.numel() for m in (model.norm, model.head) for p in m.parameters())
    return counts


def best_held_ratio(counts: Sequence[int], num_stages: int) -> float:
    """The smallest largest stage over every split of ``counts`` into ``num_stages`` contiguous non-empty stages, over
    the 1/S share: an exact dynamic programme over every stage's last block, ``O(S·N²)`` (kept apart from the
    package's :func:`~lightning_pipe.partition.balance.min_max_partition`, which it checks)."""
    prefix = [0]
    for count in counts:
        prefix.append(prefix[-1] + count)
    best = [0.0] + [math.inf] * len(counts)  # best[i]: the first i blocks as the stages so far
    for stages in range(1, num_stages + 1):
        best = [math.inf] * stages + [
            min(max(best[j], prefix[i] - prefix[j]) for j in range(stages - 1, i)) for i in range(stages, len(counts) + 1)
        ]
    return best[-1] / (prefix[-1] / num_stages)


def best_held_spread(counts: Sequence[int], num_stages: int) -> float:
    """The smallest largest-over-smallest stage over every split of ``counts`` into ``num_stages`` contiguous
    non-empty stages: for each stage sum there is as a floor, the smallest largest stage with every stage at least
    that (an exact dynamic programme, as :func:`best_held_ratio`)."""
    prefix = [0]
    for count in counts:
        prefix.append(prefix[-1] + count)
    n, spread = len(counts), math.inf
    for floor in sorted({prefix[b] - prefix[a] for a in range(n) for b in range(a + 1, n + 1)}):
        best = [0.0] + [math.inf] * n
        for stages in range(1, num_stages + 1):
            best = [math.inf] * stages + [
                min((max(best[j], prefix[i] - prefix[j]) for j in range(stages - 1, i)
                     if prefix[i] - prefix[j] >= floor), default=math.inf)
                for i in range(stages, n + 1)
            ]
        if best[-1] < math.inf:
            spread = min(spread, best[-1] / floor)
    return spread


def split_held_ratio(counts: Sequence[int], blocks_per_stage: Sequence[int]) -> float:
    """The largest stage of a given split of ``counts`` over the 1/S share."""
    ends = [sum(blocks_per_stage[: s + 1]) for s in range(len(blocks_per_stage))]
    totals = [sum(counts[a:b]) for a, b in zip([0, *ends], ends)]
    return max(totals) / (sum(counts) / len(blocks_per_stage))


def _mib(count: float) -> str:
    return f"{count / MIB:.1f}"



