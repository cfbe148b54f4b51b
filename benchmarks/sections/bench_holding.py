"""Each rank holds only what its stage runs: a Llama-shaped model with Llama-3-8B's proportions (the embedding and
the head 13% of the parameters), built on the meta device, trained with Adam on 4 and 8 stages.

Per rank, after a training step: its parameters, their gradients and Adam's two moments, against the 1/S share of
the whole model's (``share``); and its peak resident set against that share plus the fixed footprint of a process
(a tiny model's run first, in the same processes; the peak mark reset before each run). Every tensor of 64 KiB or
more has a mapping of its own (:data:`~harness.launch.SMALL_HEAP`, as in the other memory sections), so the peak
follows the live tensors; one more run of the balanced split keeps glibc's default heap, which holds on to the
freed gradients of one step while the next step's are allocated (measured: 20-30 MiB a rank here, a stage's
gradients), and its peak goes beside the others. The same rank script runs
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

from harness.launch import BENCHMARKS, REPO, SMALL_HEAP, launch
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
                now = launch(holding.measure, stages, {**spec, "runs": runs}, timeout=1800, env=SMALL_HEAP)
                old = launch(holding.measure, stages, {**spec, "runs": runs[:2]}, timeout=1800,
                             env={"PYTHONPATH": f"{BENCHMARKS}{os.pathsep}{before}", **SMALL_HEAP})
                default_heap = launch(holding.measure, stages, {**spec, "runs": [runs[0], runs[2]]}, timeout=1800)
                results[str(stages)] = {"now": now, "before": old, "default_heap": default_heap}
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", before], cwd=REPO, capture_output=True)
    return report(spec, results)


def report(spec: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    rows, worst_held, worst_peak, balance_rows, memory_holds, optimum_rows = [], 0.0, 0.0, [], [], []
    worst_default_heap = 0.0  # the balanced split's peak ratio with glibc's default heap
    bound_rows: list[list[Any]] = []  # the most even peaks any split reaches, with the costs the runs measured
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
                default_heap = "-"
                if tree == "now" and name == "parameters" and "default_heap" in result:
                    other = result["default_heap"][rank]
                    ratio = other["parameters"]["peak_bytes"] / (share + other["tiny"]["peak_bytes"])
                    worst_default_heap = max(worst_default_heap, ratio)
                    default_heap = f"{_mib(other['parameters']['peak_bytes'])} ({ratio:.2f})"
                rows.append([count, tree, name, rank, run["stage"], _mib(held), _mib(share), f"{held_ratio:.2f}",
                             _mib(run["peak_bytes"]), _mib(share + fixed), f"{peak_ratio:.2f}",
                             f"{(run['peak_bytes'] - fixed) / share:.2f}", default_heap,
                             _mib(read) if read is not None else "-"])
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
        costs_fit = peak_costs(now, ("uniform", *balanced))
        bound, bound_blocks, lowest_top = best_peak_spread(costs_fit, spec["depth"], count)
        largest_fixed = max(answer["tiny"]["peak_bytes"] for answer in now)
        stage_share = now[0]["uniform"]["whole"]["parameters"] * 4 / count
        top_ratio = (lowest_top + largest_fixed) / (stage_share + largest_fixed)
        bound_rows.append([count, f"{costs_fit['per_stage'] / MIB:.1f}", f"{costs_fit['per_block'] / MIB:.1f}",
                           f"{costs_fit['first'] / MIB:.1f}", f"{costs_fit['last'] / MIB:.1f}",
                           " ".join(map(str, bound_blocks)), f"{bound:.2f}", f"{lowest_top / MIB:.1f} ({top_ratio:.3f})"])
        split = now[0]["parameters"]["blocks_per_stage"] if "parameters" in balanced else None
        optimum_rows.append([count, f"{best_held_ratio(costs, count):.3f}", f"{best_held_spread(costs, count):.2f}",
                             f"{split_held_ratio(costs, split):.3f}" if split else "-",
                             f"{worst_by[count, 'parameters']:.3f}" if split else "-"])
    first = next(iter(results.values()))["now"][0]["uniform"]["whole"]
    table = markdown_table(
        ["stages", "tree", "balance", "rank", "stage", "held (MiB)", "1/S share (MiB)", "held / share", "peak (MiB)",
         "share + fixed (MiB)", "peak / (share + fixed)", "(peak − fixed) / share",
         "peak, glibc's default heap (MiB; / (share + fixed))", "read from the file (MiB)"], rows)
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
        " measured the same way in the same sitting. Peak: the resident set's high mark (`VmHWM`) over the run, every"
        " tensor of 64 KiB or more in a mapping of its own (`MALLOC_MMAP_THRESHOLD_=65536`, as in the other memory"
        " sections: resident memory follows the live tensors); fixed: a tiny model's peak in the same processes. The"
        " balanced split runs once more with glibc's default heap, which keeps one step's freed gradients while the"
        " next step allocates its own: its peak is in the column beside.\n\n"
        f"{table}\n\n"
        + verdict(f"with `balance='parameters'`, every rank holds at most {TARGET}× its 1/S share", worst_held <= TARGET,
                  f"{worst_held:.2f}× at worst")
        + "\n\n"
        + verdict(f"with `balance='parameters'`, every rank's peak at most {TARGET}× (share + fixed footprint)",
                  worst_peak <= TARGET, f"{worst_peak:.3f}× at worst")
        + ("\n\n" + verdict(f"the same with glibc's default heap, every rank's peak at most {TARGET}× (share + fixed"
                             " footprint)", worst_default_heap <= TARGET, f"{worst_default_heap:.3f}× at worst")
           if worst_default_heap else "")
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
        + "\n\nHow even whole blocks can make the peaks: the peaks over the fixed footprint of every run above, fitted"
        " (least squares over the middle stages) as a part every stage has plus a part per block, and the first and"
        " last stages' extra over that (the embedding; the norm, the head and the logits; each with its gradient, Adam's"
        " moments and the temporaries of Adam's step on it), give each split's peaks; the most even of every split:"
        f"\n\n{markdown_table(BOUND_HEADERS, bound_rows)}\n\nWhere the most even is above 1.10, no split of these whole"
        " blocks brings the measured peaks within 10% of each other: a block is too large a part of a stage's peak."
        f" Where the lowest largest peak (with the largest fixed footprint of the ranks) is above {TARGET}× (share +"
        " fixed), no split brings every rank's peak to the target either: the ends' extra over their held bytes"
        " (activations, the logits, the optimizer step's temporaries) is more than the target's margin."
    )
    data = {**spec, "results": results, "worst_held_ratio": worst_held, "worst_peak_ratio": worst_peak,
            "worst_default_heap_peak_ratio": worst_default_heap,
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


BOUND_HEADERS = ["stages", "every stage (MiB)", "per block (MiB)", "first stage's extra (MiB)",
                 "last stage's extra (MiB)", "the most even split (blocks per stage)", "its largest / smallest peak",
                 "the lowest largest peak of any split (MiB; + fixed, / (share + fixed))"]


def peak_costs(answers: Sequence[dict[str, Any]], names: Sequence[str]) -> dict[str, float]:
    """The measured peaks over the fixed footprint of the runs ``names``, as costs: a part every stage has and a part
    per block (a least-squares line through the middle stages), and the first and last stages' mean extra over that
    line. Needs middle stages of at least two block counts (the even split and a balanced one give them)."""
    middle, ends = [], {"first": [], "last": []}
    for name in names:
        for answer in answers:
            run = answer[name]
            blocks, stage = run["blocks_per_stage"], run["stage"]
            point = (blocks[stage], run["peak_bytes"] - answer["tiny"]["peak_bytes"])
            if 0 < stage < len(blocks) - 1:
                middle.append(point)
            else:
                ends["first" if stage == 0 else "last"].append(point)
    n = len(middle)
    mean_x, mean_y = sum(x for x, _ in middle) / n, sum(y for _, y in middle) / n
    per_block = sum((x - mean_x) * (y - mean_y) for x, y in middle) / sum((x - mean_x) ** 2 for x, _ in middle)
    per_stage = mean_y - per_block * mean_x
    extra = {end: sum(y - per_stage - per_block * x for x, y in points) / len(points) for end, points in ends.items()}
    return {"per_stage": per_stage, "per_block": per_block, **extra}


def best_peak_spread(costs: dict[str, float], num_blocks: int, num_stages: int) -> tuple[float, list[int], float]:
    """The smallest largest-over-smallest stage peak of every split of ``num_blocks`` equal blocks into
    ``num_stages`` contiguous stages, with :func:`peak_costs`' costs, its blocks per stage, and the smallest largest
    peak of every split. For each count of blocks at the two ends, the middle stages share the rest as evenly as
    whole blocks allow (the most even middle has both the smallest largest and the largest smallest stage), so trying
    every pair of end counts is exact."""
    best: tuple[float, list[int]] = (math.inf, [])
    lowest_top = math.inf
    middle_stages = num_stages - 2
    for first in range(1, num_blocks):
        for last in range(1, num_blocks - first):
            rest = num_blocks - first - last
            if rest < middle_stages:
                continue
            middle = [rest // middle_stages + (i < rest % middle_stages) for i in range(middle_stages)]
            blocks = [first, *middle, last]
            peaks = [costs["per_stage"] + costs["per_block"] * b for b in blocks]
            peaks[0] += costs["first"]
            peaks[-1] += costs["last"]
            best = min(best, (max(peaks) / min(peaks), blocks))
            lowest_top = min(lowest_top, max(peaks))
    return (*best, lowest_top)


def split_held_ratio(counts: Sequence[int], blocks_per_stage: Sequence[int]) -> float:
    """The largest stage of a given split of ``counts`` over the 1/S share."""
    ends = [sum(blocks_per_stage[: s + 1]) for s in range(len(blocks_per_stage))]
    totals = [sum(counts[a:b]) for a, b in zip([0, *ends], ends)]
    return max(totals) / (sum(counts) / len(blocks_per_stage))


def _mib(count: float) -> str:
    return f"{count / MIB:.1f}"



