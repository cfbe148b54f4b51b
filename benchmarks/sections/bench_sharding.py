"""A stage sharded over its replicas (``data_parallel="shard"`` / ``"full_shard"``, FSDP2) against replicated stages:
the Llama-3-8B-proportioned model of the holding section (:mod:`ranks.holding`), built on the meta device, trained
with Adam, on ``S`` stages × ``D`` replicas.

Per rank, after a training step: its parameters, gradients and Adam's two moments (of a sharded tensor, its shard),
against its ``1/(S·D)`` share of the whole model's; its peak resident set against that share plus the fixed
footprint of a process (a tiny model's run first, in the same processes); and the median time of a step after the
first, each mode against ``"replicate"``. The modules outside the blocks (the embedding, the final norm and the
head, 13% of this model) are sharded over the replicas of the stage that holds them, as the blocks are.
"""

from __future__ import annotations

import statistics
from typing import Any

from harness.launch import SMALL_HEAP, launch
from harness.report import markdown_table, verdict
from ranks import holding

MODES = ("replicate", "shard", "full_shard")
TARGET = 1.10
MIB = 2**20


def sizes(quick: bool) -> dict[str, Any]:
    if quick:
        return {"layouts": [[2, 2]], "width": 64, "depth": 4, "batch": 4, "length": 16, "steps": 3, "micro_batches": 2}
    return {"layouts": [[2, 2], [4, 2], [2, 4]], "width": 256, "depth": 32, "batch": 8, "length": 32, "steps": 6,
            "micro_batches": 8}


def run(quick: bool) -> dict[str, Any]:
    spec = sizes(quick)
    results = {}
    for stages, replicas in spec["layouts"]:
        runs = [{"name": "tiny", "width": 32, "depth": 8, "strategy": {"num_stages": stages}}]
        runs += [{"name": mode, "strategy": {"num_stages": stages, "data_parallel": mode, "balance": "parameters"}}
                 for mode in MODES]
        results[f"{stages}x{replicas}"] = launch(holding.measure, stages * replicas, {**spec, "runs": runs},
                                                 timeout=1800, env=SMALL_HEAP)
    return report(spec, results)


def report(spec: dict[str, Any], results: dict[str, Any]) -> dict[str, Any]:
    rows, time_rows, worst, worst_middle = [], [], {mode: 0.0 for mode in MODES}, {mode: 0.0 for mode in MODES}
    for layout, answers in results.items():
        stages, replicas = map(int, layout.split("x"))
        medians = {}
        for mode in MODES:
            for rank, answer in enumerate(answers):
                run = answer[mode]
                share = run["whole"]["parameters"] * 4 / (stages * replicas)  # parameters, gradients, 2 Adam moments
                held = sum(run["parts"].values())
                fixed = answer["tiny"]["peak_bytes"]
                ratio = held / share
                worst[mode] = max(worst[mode], ratio)
                if 0 < run["stage"] < stages - 1 or stages <= 2:  # no outside module, or no middle stage to ask
                    worst_middle[mode] = max(worst_middle[mode], ratio if 0 < run["stage"] < stages - 1 else 0.0)
                rows.append([layout, mode, rank, run["stage"], _mib(held), _mib(share), f"{ratio:.2f}",
                             _mib(run["peak_bytes"]), f"{run['peak_bytes'] / (share + fixed):.2f}"])
            counted = range(1, len(answers[0][mode]["step_seconds"]))  # the first step allocates: not counted
            medians[mode] = statistics.median(max(answer[mode]["step_seconds"][i] for answer in answers) for i in counted)
        time_rows.append([layout, *(f"{medians[mode] * 1e3:.1f}" for mode in MODES),
                          *(f"{medians[mode] / medians['replicate']:.2f}" for mode in MODES[1:])])
    table = markdown_table(["layout (S×D)", "data_parallel", "rank", "stage", "held (MiB)", "1/(S·D) share (MiB)",
                            "held / share", "peak (MiB)", "peak / (share + fixed)"], rows)
    times = markdown_table(["layout (S×D)", *(f"step, {mode} (ms)" for mode in MODES),
                            *(f"{mode} / replicate" for mode in MODES[1:])], time_rows)
    middle = {mode: worst_middle[mode] for mode in MODES if worst_middle[mode] > 0}
    markdown = (
        f"The Llama-shaped model of the holding section (width {spec['width']}, {spec['depth']} blocks), built in"
        f" `configure_model()`, Adam, `balance='parameters'`, batch {spec['batch']} × {spec['length']} tokens per"
        f" replica, {spec['steps']} steps, {spec['micro_batches']} micro-batches. Held: the rank's parameters,"
        " gradients and Adam moments after a step (of a sharded tensor, this rank's shard); share: a 1/(S·D) part of"
        " the whole model's. Peak: the resident set's high mark over the run (`MALLOC_MMAP_THRESHOLD_=65536`); fixed:"
        f" a tiny model's peak in the same processes.\n\n{table}\n\n"
        + verdict(f"with `full_shard`, every rank holds at most {TARGET}× its 1/(S·D) share", worst["full_shard"] <= TARGET,
                  f"{worst['full_shard']:.2f}× at worst")
        + ("\n\n" + verdict(f"with `full_shard`, every middle stage's rank (no module outside the blocks) holds at"
                              f" most {TARGET}× its share", middle["full_shard"] <= TARGET,
                              f"{middle['full_shard']:.2f}× at worst")
           if "full_shard" in middle else "")
        + "\n\nThe embedding, the final norm and the head are sharded over their stage's replicas as the blocks"
        " are, so the ends' ranks hold their share too. Between steps `shard` holds what `full_shard` holds;"
        " during a step it also holds the stage's whole weights and whole gradient (the peak column).\n\n"
        f"The median step (the slowest rank's, after the first step):\n\n{times}\n\n"
        "A step's collectives are counted by `tests/test_sharded_data_parallel.py`: one all-gather and one"
        " reduce-scatter per block per step under `shard`, `2M` gathers and `M` reduce-scatters under `full_shard` (a"
        " module outside the blocks: reduce-scattered once per step in both)."
    )
    data = {"spec": spec, "results": results, "worst_held_over_share": worst, "worst_middle": middle}
    return {"title": "A stage sharded over its replicas", "markdown": markdown, "data": data}


def _mib(value: float) -> str:
    return f"{value / MIB:.1f}"
