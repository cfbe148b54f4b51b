"""``python -m lightning_pipe.commands SUBCOMMAND [ARGS...]``: the ``lightning-pipe`` console script, uninstalled."""

from lightning_pipe.commands import main

main()
