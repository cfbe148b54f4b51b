"""Pretrained weights read per stage: peak resident memory per rank while the weights load and in the first steps,
and the time to load, against ``from_pretrained`` in ``__init__``.

A Llama of about 1 GiB in bfloat16 (untied embeddings, a small vocabulary so that the layers hold most of it) is
saved with ``save_pretrained`` as sharded safetensors, as models on the Hugging Face Hub are stored, then fine-tuned
in float32 for a few steps on 4 stages (2 in quick mode) with SGD with momentum, in three runs in the same processes
(see :mod:`ranks.pretrained`): a tiny model first, whose peak is the fixed footprint of a process; the model loaded
with ``from_pretrained(DIR, dtype=torch.float32)`` in ``__init__`` (every rank converts and holds all of it, then
keeps its stage); and the model built in ``configure_model()`` with ``GPipeStrategy(pretrained=DIR)``, each rank
reading only its stage's and the replicated modules' tensors, in the precision's dtype. Before each large run, and
between its load and its steps, the garbage is collected and the kernel's peak-RSS mark reset.

NOTE: every tensor of 64 KiB or more gets its own mapping (``MALLOC_MMAP_THRESHOLD_``, as the memory tests set it),
so that resident memory follows the live tensors. With glibc's default, the threshold rises to 32 MiB as large
blocks are freed, and the heap then keeps freed weight-sized blocks (6-25 MiB here): measured, 0.3-0.5 GiB more
per rank in the steps than the live tensors, for either way of loading.

NOTE: a checkpoint already in the training dtype is memory-mapped by ``from_pretrained`` (transformers 5) rather
than read: on the CPU it then costs resident memory only where pages are touched. A conversion, as here, or an
older ``transformers`` reads all of it on every rank.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from harness.launch import SMALL_HEAP, launch
from harness.report import markdown_table, verdict
from ranks import pretrained

TARGET_RATIO = 1.2  # peak with per-stage reading over (stage share + fixed footprint)
GIB = 2**30


def sizes(quick: bool) -> dict[str, Any]:
    if quick:  # checks that the section runs: two processes, a tiny model
        return {"stages": 2, "hidden": 32, "intermediate": 64, "layers": 4, "heads": 4, "vocab": 128,
                "batch": 2, "sequence": 8, "steps": 1, "shard": "100KB"}
    # 18 layers of 28.3 M parameters and 2 × 12.6 M of embeddings: 0.99 GiB in bfloat16, 1.99 GiB in float32.
    return {"stages": 4, "hidden": 1536, "intermediate": 4096, "layers": 18, "heads": 16, "vocab": 8192,
            "batch": 2, "sequence": 32, "steps": 2, "shard": "256MB"}


def save_llama(path: Path, spec: dict[str, Any], layers: int, shard: str) -> int:
    """A Llama of the spec's shape with random weights, saved in bfloat16 as sharded safetensors; its parameter
    count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=spec["vocab"], hidden_size=spec["hidden"], intermediate_size=spec["intermediate"],
                         num_hidden_layers=layers, num_attention_heads=spec["heads"],
                         num_key_value_heads=spec["heads"], max_position_embeddings=spec["sequence"],
                         tie_word_embeddings=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():  # faster than the library's initialisation, and as good for memory
            parameter.normal_(0.0, 0.02, generator=generator)
    model.save_pretrained(path, max_shard_size=shard)
    return sum(p.numel() for p in model.parameters())


def run(quick: bool) -> dict[str, Any]:
    spec = sizes(quick)
    stages = spec["stages"]
    with tempfile.TemporaryDirectory(prefix="lightning_pipe_pretrained_") as tmp:
        parameters = save_llama(Path(tmp) / "model", spec, spec["layers"], spec["shard"])
        tiny = {**spec, "hidden": 32, "intermediate": 64, "heads": 4}  # the same vocabulary: the same tokens
        save_llama(Path(tmp) / "tiny", tiny, spec["stages"], "10MB")  # a layer per stage
        files = len(list((Path(tmp) / "model").glob("*.safetensors")))
        answers = launch(pretrained.measure, stages, {**spec, "path": str(Path(tmp) / "model"),
                                                       "tiny_path": str(Path(tmp) / "tiny")}, env=SMALL_HEAP)
    rows, data_rows = [], []
    for rank, answer in enumerate(answers):
        per_stage, whole, tiny_run = answer["per_stage"], answer["from_pretrained"], answer["tiny"]
        fixed = max(tiny_run["load_peak_bytes"], tiny_run["steps_peak_bytes"])
        share = per_stage["share_bytes"]
        worst = max(per_stage["load_peak_bytes"], per_stage["steps_peak_bytes"]) / (share + fixed)
        row = {"rank": rank, "stage": per_stage["stage"], "share_bytes": share, "fixed_bytes": fixed,
               "per_stage": per_stage, "from_pretrained": whole, "ratio": worst}
        data_rows.append(row)
        rows.append([
            rank, row["stage"], _gib(share), _gib(fixed), _gib(share + fixed),
            _gib(per_stage["load_peak_bytes"]), _gib(per_stage["steps_peak_bytes"]), f"{worst:.2f}",
            f"{per_stage['load_s']:.1f}", _gib(whole["load_peak_bytes"]), _gib(whole["steps_peak_bytes"]),
            f"{whole['load_s']:.1f}",
        ])
    table = markdown_table(
        ["rank", "stage", "stage share (GiB)", "fixed footprint (GiB)", "share + fixed (GiB)",
         "load, per stage (GiB)", "steps, per stage (GiB)", "worst over share + fixed", "load time, per stage (s)",
         "load, from_pretrained (GiB)", "steps, from_pretrained (GiB)", "load time, from_pretrained (s)"],
        rows,
    )
    worst = max(row["ratio"] for row in data_rows)
    saved = min(r["from_pretrained"]["load_peak_bytes"] - r["per_stage"]["load_peak_bytes"] for r in data_rows)
    markdown = (
        f"Llama ({spec['layers']} layers, hidden {spec['hidden']}, vocabulary {spec['vocab']}, untied embeddings):"
        f" {parameters * 2 / GIB:.2f} GiB in bfloat16, saved with `save_pretrained` as {files} safetensors shards"
        f" (as Hub checkpoints are stored); fine-tuned in float32 ({parameters * 4 / GIB:.2f} GiB of parameters) on"
        f" {stages} stages, batch {spec['batch']} × {spec['sequence']} tokens, {spec['steps']} steps, SGD with"
        " momentum, one compute thread per process, every tensor of 64 KiB or more in a mapping of its own"
        " (`MALLOC_MMAP_THRESHOLD_=65536`: resident memory follows the live tensors; see the section's module)."
        " Peak resident set per rank"
        " (`VmHWM`) from the model's construction until set-up has loaded the weights (*load*: `on_fit_start`),"
        " then, the mark reset, through the training steps (*steps*). *Per stage*: built in `configure_model()`,"
        " `GPipeStrategy(pretrained=DIR)` (float32: the precision's dtype); *from_pretrained*:"
        " `AutoModelForCausalLM.from_pretrained(DIR, dtype=torch.float32)` in `__init__`, every rank converting all"
        " of it. (A checkpoint already in the training dtype, `from_pretrained` of transformers 5 memory-maps"
        " instead of reading: on the CPU it costs resident memory only where it is touched.) Stage share: the"
        " rank's parameters (its layers and the embeddings, head and norm every stage holds), gradients and"
        " momentum. Fixed footprint: the peak of the same run with a Llama of one tiny layer per stage, in fresh"
        " processes. Load time: from the model's construction to `on_fit_start` (process-group set-up excluded; it"
        " ran before).\n\n"
        f"{table}\n\n"
        + verdict(
            f"every rank's peak while loading and in the first steps within {TARGET_RATIO}× (stage share + fixed"
            " footprint)",
            worst <= TARGET_RATIO,
            f"{worst:.2f}× at worst",
        )
        + f"\n\nReading per stage lowers the peak while loading by {saved / 2**20:.0f} MiB on the rank where it gains"
        " least: converted by `from_pretrained` in `__init__`, the whole model is on every rank, one copy per"
        " process on a node."
    )
    data = {**spec, "parameters": parameters, "files": files, "rows": data_rows, "worst_ratio": worst,
            "target_ratio": TARGET_RATIO}
    return {"title": "Pretrained weights read per stage", "markdown": markdown, "data": data}


def _gib(count: float) -> str:
    return f"{count / GIB:.2f}"
