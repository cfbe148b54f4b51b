"""Memory-efficient setup: peak resident memory per rank with and without deferred construction, through ``fit``,
``test`` and checkpointing.

A stack of ``depth`` × (Linear(W, W) + ReLU), about 2 GiB of parameters at full size, trains for a few steps on 4
stages (2 in quick mode), with SGD with momentum, so that each stage's share is its parameters, their gradients and
one optimizer buffer of the same size. The processes (one per stage) run three runs in turn: a tiny model first,
whose peak is the fixed footprint of a process (Python, torch, Lightning, the process group, the Trainer, and the
code of testing and sharded checkpointing, which it runs too); then the model built in ``__init__`` (every rank
builds all of it; fit only); then built in ``configure_model()`` (every rank materialises only its stage). Before
each of the later runs, and before each phase of the deferred run, the garbage is collected and the kernel's
peak-RSS mark reset (``/proc/self/clear_refs``), so each peak is that phase's own, over the footprint already there;
whatever the earlier runs left behind counts against the deferred run, the last. Each rank reports its peak
resident set (``VmHWM``) in each phase of the deferred run: setup and training (read when training ends); the end of
``fit`` (its teardown: a model built on the meta device stays distributed, nothing is gathered); ``trainer.test``;
and ``trainer.save_checkpoint`` after them (sharded by default for such a model: each rank writes its own stage).
"""

from __future__ import annotations

from typing import Any

from harness.launch import launch
from harness.report import markdown_table, verdict
from ranks import memory_setup


TARGET_RATIO = 1.2  # peak with deferred construction over (stage share + fixed footprint)
GIB = 2**30
PHASES = ("fit", "after_fit", "test", "checkpoint")


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
        fixed = max(tiny[rank]["phases"].values())
        share = deferred[rank]["share_bytes"]
        phases = deferred[rank]["phases"]
        row = {
            "rank": rank,
            "stage": deferred[rank]["stage"],
            "share_bytes": share,
            "fixed_bytes": fixed,
            "peak_deferred_bytes": phases["fit"],
            "phases_deferred_bytes": phases,
            "peak_whole_bytes": whole[rank]["phases"]["fit"],
            "after_fit_deferred_bytes": phases["after_fit"],
            "ratio": max(phases.values()) / (share + fixed),
        }
        data_rows.append(row)
        rows.append([
            rank, row["stage"], _gib(share), _gib(fixed), _gib(share + fixed),
            *(_gib(phases[phase]) for phase in PHASES), f"{row['ratio']:.2f}", _gib(row["peak_whole_bytes"]),
        ])
    table = markdown_table(
        ["rank", "stage", "stage share (GiB)", "fixed footprint (GiB)", "share + fixed (GiB)",
         "fit (GiB)", "end of fit (GiB)", "test (GiB)", "checkpoint (GiB)",
         "worst over share + fixed", "fit, built in __init__ (GiB)"],
        rows,
    )
    worst = max(row["ratio"] for row in data_rows)
    saved = min(row["peak_whole_bytes"] - row["peak_deferred_bytes"] for row in data_rows)
    parameters = whole[0]["model_parameters"]
    markdown = (
        f"{spec['depth']} × (Linear({spec['width']}, {spec['width']}) + ReLU): {parameters * 4 / GIB:.2f} GiB of"
        f" parameters on {stages} stages, batch {spec['batch']}, {spec['steps']} training steps, SGD with momentum;"
        " one compute thread per process. Peak resident set per rank (`VmHWM`) in each phase of the run built in"
        " `configure_model()`: setup and training (`fit`), the end of fit (its teardown), `trainer.test`, and"
        " `trainer.save_checkpoint` after them (sharded: each rank writes its own stage). Stage share: the rank's"
        " parameters, gradients and momentum buffers. Fixed footprint: the peak of the same phases with a"
        " 4 × Linear(16, 16) model, in fresh processes; the two large runs follow in the same processes, the peak"
        " mark reset before each phase (see the module's docstring). The model stays distributed after fit: no"
        " rank receives another stage's layers.\n\n"
        f"{table}\n\n"
        + verdict(
            f"every phase's peak with `configure_model()` within {TARGET_RATIO}× (stage share + fixed footprint) on"
            " every rank",
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
