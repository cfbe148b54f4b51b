"""Timeline traces of pipeline steps: recorded on every stage, written as a Chrome trace, drawn as a PNG.

``GPipeStrategy(trace_steps=[3, 4], trace_dir="traces")`` writes ``traces/gpipe_trace.json`` (and says where): one
track per stage, with the forward, backward, re-computation, send and wait intervals of the chosen steps on one
clock. Open it in https://ui.perfetto.dev or ``chrome://tracing``, or draw it::

    lightning-pipe trace render traces/gpipe_trace.json timeline.png   # needs matplotlib (the plot extra)

Holds: :mod:`~lightning_pipe.trace.timeline` records what one stage did in a step (the engine feeds it);
:mod:`~lightning_pipe.trace.tracer` gathers the stages' timelines on one clock during training, logs the bubble and
writes the traced steps; :mod:`~lightning_pipe.trace.chrome` is the file format, :mod:`~lightning_pipe.trace.picture`
the PNG, and :func:`main` the command line. :mod:`~lightning_pipe.trace.stage_summary` is the start-up's stage
table: what each stage holds, where it runs, what it costs.

May import: ``schedules``, ``partition``. Imported by ``execution`` (the engine feeds a timeline) and the
strategy.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from lightning_pipe.trace.chrome import TracedStep, chrome_trace, write_chrome_trace
from lightning_pipe.trace.picture import render_png

__all__ = ["TracedStep", "chrome_trace", "main", "render_png", "write_chrome_trace"]


def main(argv: Sequence[str] | None = None) -> None:
    """The command line: ``lightning-pipe trace render TRACE.json OUT.png [--title TITLE]`` (or ``python -m
    lightning_pipe.trace render ...``)."""
    parser = argparse.ArgumentParser(prog="lightning-pipe trace", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    render = commands.add_parser("render", help="draw a trace file as a PNG Gantt chart")
    render.add_argument("trace", type=Path, help="a Chrome trace JSON written by GPipeStrategy(trace_steps=...)")
    render.add_argument("out", type=Path, help="the PNG to write")
    render.add_argument("--title", default=None)
    args = parser.parse_args(argv)
    render_png(json.loads(args.trace.read_text()), args.out, args.title)
    print(f"wrote {args.out}")
