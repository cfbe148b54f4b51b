"""``python -m lightning_pipe.trace render TRACE.json OUT.png``: draw a trace as a PNG."""

from lightning_pipe.trace import main

main()
