"""The pipeline bubble: measured idle fraction of each step against GPipe's ``(S - 1) / (M + S - 1)``.

Two stages of equal blocks (2 × (Linear(W, W) + ReLU) each, He-initialised: :func:`harness.stack.he_block`), one
compute thread per process, ``checkpoint="never"``.
For each micro-batch count M the strategy logs ``pipeline/bubble_fraction`` every step: the share of the step's
compute window (first forward to last backward, on any stage) that stages spend outside forward and backward,
averaged over stages. Communication, the loss and Python between micro-batches count as bubble, so the measured
fraction sits above the formula, which assumes free communication.

``python benchmarks/timeline.py docs/images/timeline.png`` traces one step at M=4 and draws it.
"""

from __future__ import annotations

from typing import Any

from harness.launch import launch
from harness.report import markdown_table
from lightning_pipe.schedules.builtin import SCHEDULES
from lightning_pipe.schedules.simulator import ideal_bubble
from ranks import bubble


NUM_STAGES = 2
MICRO_BATCHES = (1, 2, 4, 8)


def sizes(quick: bool) -> dict[str, Any]:
    if quick:
        return {"width": 64, "blocks": 4, "batch": 32, "steps": 4, "micro_batches": list(MICRO_BATCHES)}
    return {"width": 512, "blocks": 8, "batch": 256, "steps": 12, "micro_batches": list(MICRO_BATCHES)}


def run(quick: bool) -> dict[str, Any]:
    spec = sizes(quick)
    answer = launch(bubble.measure, NUM_STAGES, spec)[0]
    rows = []
    for m, result in zip(spec["micro_batches"], answer["results"]):
        ideal = ideal_bubble(SCHEDULES["gpipe"], NUM_STAGES, m, 1)
        rows.append([m, f"{ideal:.3f}", f"{result['bubble_fraction']:.3f}", f"{result['bubble_fraction'] - ideal:+.3f}",
                     f"{1e3 * result['step_s']:.1f}"])
    table = markdown_table(
        ["M", "formula (S-1)/(M+S-1)", "measured bubble (median)", "measured - formula", "step (ms, median)"], rows
    )
    markdown = (
        f"{spec['blocks']} blocks of 2 × (Linear({spec['width']}, {spec['width']}) + ReLU), batch {spec['batch']},"
        f" {NUM_STAGES} stages of equal blocks, `checkpoint=\"never\"`, one thread per process; median over the"
        f" steps of one fit of {spec['steps']} steps per M (the first step dropped). The measured bubble is"
        " `pipeline/bubble_fraction` as the strategy logs it: the idle share of each step's compute window (first"
        " forward to last backward on any stage), averaged over stages; sends, receives, the loss and the Python"
        " between micro-batches count as idle.\n\n"
        f"{table}"
    )
    return {"title": "Pipeline bubble", "markdown": markdown, "data": {**spec, **answer}}
