"""Memory-efficient setup: peak resident memory per rank with and without deferred construction.

A stack of ``depth`` × (Linear(W, W) + ReLU), about 2 GiB of parameters at full size, trains for a few steps on 4
stages (2 in quick mode), with SGD with momentum, so that each stage's share is its parameters, their gradients and
one optimizer buffer of the same size. The processes (one per stage) run three fits in turn: a tiny model first,
whose peak is the fixed footprint of a process (Python, torch, Lightning, the process group, the Trainer); then the
model built in ``__init__`` (every rank builds all of it); then built in ``configure_model()`` (every rank
materialises only its stage). Before each of the later fits the previous model is freed and the kernel's peak-RSS
mark reset (``/proc/self/clear_refs``), so each peak is that fit's own, over the footprint already there; whatever
the earlier fits left behind counts against the deferred run, the last. Each rank reports its peak resident set
(``ru_maxrss``) at the end of training, before teardown: setup and training, the phase that must fit. After ``fit``
a model built deferred comes whole to global rank 0, which then holds it in host memory once, as a consolidated
checkpoint does; that peak has its own column.
"""

from __future__ import annotations

from typing import Any

from harness.launch import launch
from harness.report import markdown_table, verdict
from ranks import memory_setup


TARGET_RATIO = 1.2  # peak with deferred construction over (stage share + fixed footprint)
GIB = 2**30


def sizes(quick: bool) -> dict[str, int]:
    if quick:  # checks that the section runs: two processes, a tiny model
        return {"stages": 2, "width": 64, "depth": 8, "batch": 8, "steps": 2}
    # 32 × 4096² float32 weights: 2.0 GiB of parameters, 512 MiB per stage.
    return {"stages": 4, "width": 4096, "depth": 32, "batch": 8, "steps": 3}


def run(quick: bool) -> dict[str, Any]:
    spec = sizes(quick)
    stages = spec["stages"]
    answers = launch(memory_setup.measure, stages, spec)
    tiny, whole, deferred = ([answer[name] for answer in answers] for name in ("tiny", "whole", "deferred"))
    rows, data_rows = [], []
    for rank in range(stages):
        fixed = tiny[rank]["peak_bytes"]
        share = deferred[rank]["share_bytes"]
        row = {
            "rank": rank,
            "stage": deferred[rank]["stage"],
            "share_bytes": share,
            "fixed_bytes": fixed,
            "peak_deferred_bytes": deferred[rank]["peak_bytes"],
            "peak_whole_bytes": whole[rank]["peak_bytes"],
            "after_fit_deferred_bytes": deferred[rank]["after_fit_bytes"],
            "ratio": deferred[rank]["peak_bytes"] / (share + fixed),
        }
        data_rows.append(row)
        rows.append([
            rank, row["stage"], _gib(share), _gib(fixed), _gib(share + fixed), _gib(row["peak_deferred_bytes"]),
            f"{row['ratio']:.2f}", _gib(row["peak_whole_bytes"]), _gib(row["after_fit_deferred_bytes"]),
        ])
    table = markdown_table(
        ["rank", "stage", "stage share (GiB)", "fixed footprint (GiB)", "share + fixed (GiB)",
         "peak, configure_model (GiB)", "over share + fixed", "peak, built in __init__ (GiB)",
         "after fit, configure_model (GiB)"],
        rows,
    )
    worst = max(row["ratio"] for row in data_rows)
    saved = min(row["peak_whole_bytes"] - row["peak_deferred_bytes"] for row in data_rows)
    parameters = whole[0]["model_parameters"]
    markdown = (
        f"{spec['depth']} × (Linear({spec['width']}, {spec['width']}) + ReLU): {parameters * 4 / GIB:.2f} GiB of"
        f" parameters on {stages} stages, batch {spec['batch']}, {spec['steps']} training steps, SGD with momentum;"
        " one compute thread per process. Peak resident set per rank (`ru_maxrss`) through setup and training."
        " Stage share: the rank's parameters, gradients and momentum buffers. Fixed footprint: the peak of the same"
        " run with a 4 × Linear(16, 16) model, in fresh processes; the two large runs follow in the same processes,"
        " the peak mark reset before each (see the module's docstring). After fit, global rank 0 (the last"
        " stage) receives the other stages' trained layers, so that the launching process holds the whole model as"
        " on one device.\n\n"
        f"{table}\n\n"
        + verdict(
            f"peak with `configure_model()` within {TARGET_RATIO}× (stage share + fixed footprint) on every rank",
            worst <= TARGET_RATIO,
            f"{worst:.2f}× at worst",
        )
        + f"\n\nBuilt in `__init__`, every rank holds all stages' parameters: deferred construction lowers the peak by"
        f" {saved / 2**20:.0f} MiB on the rank where it gains least."
    )
    data = {**spec, "model_parameters": parameters, "rows": data_rows,
            "worst_ratio": worst, "target_ratio": TARGET_RATIO}
    return {"title": "Memory-efficient setup: deferred construction", "markdown": markdown, "data": data}


def _gib(count: float) -> str:
    return f"{count / GIB:.2f}"
