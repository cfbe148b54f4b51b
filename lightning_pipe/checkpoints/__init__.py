"""Weights in and out of a pipelined model: checkpoints, pretrained weights, and the trained model exported.

Holds: optimizer states numbered by parameter name (``optimizer_states``), the whole model gathered from and split
back onto the stages (``whole_model``), sharded checkpoints through ``torch.distributed.checkpoint`` (``sharded``),
committed whole or not at all (``commit``) and checked whole before they are read (``integrity``),
weights read from files a tensor at a time (``stored_weights``), stored names placed as ``from_pretrained`` places
them (``stored_names``), pretrained weights mapped onto the model
(``pretrained``), the Hugging Face export (``export``), and what the strategy's checkpoint hooks do on one rank
(``strategy_io``). The two commands that use them, ``lightning-pipe consolidate_checkpoint`` and
``lightning-pipe export_pretrained``, are in :mod:`lightning_pipe.commands`.

May import: everything below it (``schedules`` to ``execution``). Imported by ``settings``, ``integration``,
``pipeline``, the strategy and the two commands.
"""
