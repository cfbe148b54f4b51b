"""A traced step drawn as a PNG: one row per stage, each forward, backward, re-computation, send and wait a bar."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_pipe.trace.timeline import BACKWARD, FORWARD, KINDS, RECOMPUTE, SEND, WAIT

_COLORS = {FORWARD: "#4C78A8", BACKWARD: "#F58518", RECOMPUTE: "#FFD8A8", SEND: "#222222", WAIT: "#E4E4E4"}


def render_png(trace: dict[str, Any], out: Path, title: str | None = None) -> None:
    """Draw a Chrome trace written by :func:`write_chrome_trace` as a Gantt chart, one row per stage."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as error:
        raise ImportError(
            "rendering a trace needs matplotlib; install it with `pip install lightning-pipe[plot]`"
            " (or `pip install matplotlib`)."
        ) from error

    intervals = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in KINDS]
    if not intervals:
        raise ValueError("the trace holds no pipeline intervals; was it written by GPipeStrategy(trace_steps=...)?")
    num_stages = 1 + max(e["tid"] for e in intervals)
    figure, axes = plt.subplots(figsize=(12, 0.8 + 0.7 * num_stages))
    # Drawing order: waits at the back, recomputation over its backward, sends on top.
    layers = {WAIT: (0.15, 0.7), FORWARD: (0.15, 0.7), BACKWARD: (0.15, 0.7), RECOMPUTE: (0.3, 0.4), SEND: (0.05, 0.1)}
    for kind, (offset, height) in layers.items():
        for event in (e for e in intervals if e["cat"] == kind):
            row = num_stages - 1 - event["tid"] + offset  # stage 0 on top
            start, width = event["ts"] / 1e3, max(event["dur"] / 1e3, 1e-3)
            axes.broken_barh(
                [(start, width)], (row, height), facecolors=_COLORS[kind], edgecolors="white", linewidth=0.3
            )
            if kind in (FORWARD, BACKWARD):
                axes.text(start + width / 2, row + height / 2, str(event["args"]["micro_batch"]), ha="center",
                          va="center", fontsize=7, color="white", clip_on=True)
    names = {
        e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("ph") == "M" and e["name"] == "thread_name"
    }
    axes.set_yticks([num_stages - 1 - s + 0.5 for s in range(num_stages)])
    axes.set_yticklabels([names.get(s, f"stage {s}") for s in range(num_stages)])
    axes.set_ylim(0, num_stages)
    axes.set_xlabel("time (ms)")
    steps = trace.get("otherData", {}).get("steps", [])
    if title is None:
        title = "GPipe timeline"
        if steps:
            title += "; " + ", ".join(
                f"step {s['step']}: bubble {s['bubble_fraction']:.2f} (ideal {s['ideal_bubble_fraction']:.2f})"
                for s in steps
            )
    axes.set_title(title, fontsize=10)
    figure.legend(
        handles=[Patch(color=_COLORS[k], label=k) for k in (FORWARD, BACKWARD, RECOMPUTE, SEND, WAIT)],
        loc="lower center", ncol=5, fontsize=8, frameon=False,
    )
    axes.grid(axis="x", alpha=0.3)
    figure.tight_layout(rect=(0, 0.1 + 0.1 / num_stages, 1, 1))
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=150)
    plt.close(figure)
