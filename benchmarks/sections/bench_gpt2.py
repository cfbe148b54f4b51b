"""GPT-2 from ``transformers``, unchanged, on 2 stages against one process.

The model is Hugging Face's ``GPT2LMHeadModel`` as its users train it (blocks in the ``ModuleList``
``transformer.h``, called in the library's own loop; the loss from ``labels=``). The pipeline runs under
``Trainer(strategy="gpipe")``, so its step includes Lightning's loop; the references are plain loops on one
process. As in the pipeline section, the ideal step is ``(M + S - 1) * t_mb / S`` with ``t_mb`` one process's
forward + backward of one micro-batch through the whole model (the bubble already included), and the efficiency is
that ideal over the measured step. See :mod:`ranks.gpt2` for the method.
"""

from __future__ import annotations

from typing import Any

import ranks.gpt2
from harness.launch import launch
from harness.report import markdown_table
from harness.summarize import median, median_ratio

NUM_STAGES = 2
FULL = {
    "model": {"layers": 8, "width": 256, "heads": 4, "vocab": 2048, "sequence": 64},
    "batch": 32, "micro_batches": 8, "steps": 4, "rounds": 3,
}
QUICK = {
    "model": {"layers": 2, "width": 32, "heads": 2, "vocab": 64, "sequence": 8},
    "batch": 8, "micro_batches": 2, "steps": 2, "rounds": 1,
}


def run(quick: bool) -> dict[str, Any]:
    spec = QUICK if quick else FULL
    answer = launch(ranks.gpt2.measure, NUM_STAGES, spec)[0]  # global rank 0: the last stage, where steps end
    s, m = NUM_STAGES, spec["micro_batches"]
    # Per round: the median step of each; the ratios are medians over rounds of the ratio within a round.
    one = [median(r) for r in answer["one_process_s"]]
    t_mb = [median(r) for r in answer["micro_batch_s"]]
    pipe = [median(r) for r in answer["pipeline_s"]]
    ideal = [(m + s - 1) * t / s for t in t_mb]
    row = {
        "t_one_s": median(one), "t_pipeline_s": median(pipe), "t_mb_s": median(t_mb), "ideal_step_s": median(ideal),
        "speedup": median_ratio(one, pipe), "ideal_speedup": s * m / (m + s - 1),
        "efficiency": median_ratio(ideal, pipe), "bubble": (s - 1) / (m + s - 1),
    }
    size = spec["model"]
    table = markdown_table(
        ["S", "M", "one process (ms)", "pipeline (ms)", "speedup", "ideal S·M/(M+S-1)", "t_mb (ms)",
         "ideal step (ms)", "efficiency", "bubble (S-1)/(M+S-1)"],
        [[s, m, f"{1e3 * row['t_one_s']:.1f}", f"{1e3 * row['t_pipeline_s']:.1f}", f"{row['speedup']:.2f}",
          f"{row['ideal_speedup']:.2f}", f"{1e3 * row['t_mb_s']:.1f}", f"{1e3 * row['ideal_step_s']:.1f}",
          f"{row['efficiency']:.3f}", f"{row['bubble']:.3f}"]],
    )
    markdown = (
        f"`GPT2LMHeadModel` ({size['layers']} layers, width {size['width']}, {size['heads']} heads, vocabulary"
        f" {size['vocab']}, {answer['parameters'] / 1e6:.1f} M parameters), batch {spec['batch']} × {size['sequence']}"
        f" tokens, SGD, one thread per process, `checkpoint=\"never\"`; {spec['rounds']} rounds, each of"
        f" {spec['steps']} one-process steps, {spec['steps']} one-micro-batch steps and a `Trainer.fit` of"
        f" {spec['steps'] + 1} pipelined steps (the first dropped). The pipelined step includes Lightning's loop and"
        " the optimizer step; t_mb (forward and backward of one micro-batch) does not, so the efficiency is a lower"
        " bound of the engine's. The embeddings and the final norm and head run whole on every stage (the"
        " blocks of `transformer.h` are pipelined), which the ideal step does not count either.\n\n"
        f"{table}"
    )
    return {"title": "GPT-2 from transformers", "markdown": markdown, "data": {"spec": spec, **answer, **row}}
