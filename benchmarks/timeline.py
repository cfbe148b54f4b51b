"""Trace one training step of the pipeline bubble section's model (2 stages, M=4) and draw it.

Usage::

    python benchmarks/timeline.py docs/images/timeline.png   # also writes docs/images/timeline.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from harness.launch import launch
from lightning_pipe.trace import render_png
from ranks import bubble
from sections.bench_bubble import NUM_STAGES, sizes


def main(out: Path) -> None:
    spec = {**sizes(False), "steps": 4}
    trace = launch(bubble.trace_one_step, NUM_STAGES, spec)[0]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(trace))
    step = trace["otherData"]["steps"][0]
    render_png(
        trace, out,
        title=f"GPipe, {NUM_STAGES} stages, M={bubble.TIMELINE_MICRO_BATCHES}, one traced training step on CPU: bubble"
        f" {step['bubble_fraction']:.2f} measured, {step['ideal_bubble_fraction']:.2f} by the formula",
    )
    print(f"wrote {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
