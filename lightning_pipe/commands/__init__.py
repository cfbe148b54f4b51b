"""The commands, under one console script ``lightning-pipe`` (``python -m lightning_pipe.commands`` where the script
is not installed)::

    lightning-pipe plan --stages 4                         # which schedule, M, v and checkpoint mode to use
    lightning-pipe export_pretrained CHECKPOINT OUT_DIR    # a checkpoint's model as a Hugging Face directory
    lightning-pipe consolidate_checkpoint SHARDED_DIR OUT.ckpt
    lightning-pipe trace render TRACE.json OUT.png         # draw a trace written by GPipeStrategy(trace_steps=...)

Each subcommand takes the arguments its module's ``main`` takes (``lightning-pipe plan --help``); the former forms
``python -m lightning_pipe.plan``, ``python -m lightning_pipe.export_pretrained``, ``python -m
lightning_pipe.commands.consolidate_checkpoint`` and ``python -m lightning_pipe.trace`` still run the same commands.

Holds: the dispatcher (:func:`main`) and the commands it runs (``plan``, ``export_pretrained``,
``consolidate_checkpoint``; ``trace`` is :mod:`lightning_pipe.trace`'s).

May import: everything below the strategy (``pipeline`` and lower). Imported by: nothing of the package.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# Each subcommand, its module (with a `main(argv)`) and what it does, as `lightning-pipe --help` lists them.
SUBCOMMANDS = {
    "plan": ("lightning_pipe.commands.plan", "rank schedules x micro-batches x virtual stages x checkpoint modes"),
    "export_pretrained": ("lightning_pipe.commands.export_pretrained", "write a checkpoint as a Hugging Face directory"),
    "consolidate_checkpoint": ("lightning_pipe.commands.consolidate_checkpoint", "turn a sharded checkpoint into one file"),
    "trace": ("lightning_pipe.trace", "draw a trace written by GPipeStrategy(trace_steps=...) as a PNG"),
}


def main(argv: Sequence[str] | None = None) -> None:
    """``lightning-pipe SUBCOMMAND [ARGS...]``: run the subcommand's ``main`` with the rest of the arguments."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        listed = "\n".join(f"  {name:<24}{about}" for name, (_, about) in SUBCOMMANDS.items())
        print(f"usage: lightning-pipe SUBCOMMAND [ARGS...]\n\nsubcommands:\n{listed}\n\n"
              "`lightning-pipe SUBCOMMAND --help` says what each takes.")
        if not args:
            raise SystemExit(2)
        return
    name, rest = args[0], args[1:]
    if name not in SUBCOMMANDS:
        raise SystemExit(
            f"lightning-pipe: unknown subcommand {name!r}; use one of {', '.join(SUBCOMMANDS)}"
            " (`lightning-pipe --help` lists them)."
        )
    module = importlib.import_module(SUBCOMMANDS[name][0])
    module.main(rest)
