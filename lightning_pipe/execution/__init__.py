"""One rank running its stage: the step runtime, the engine that executes the schedule, and the stage's blocks.

Holds what a training step descends through: strategy -> ``steps`` (the training step in its schedule's mode,
whole-batch or per-micro-batch, chosen once) -> ``runtime`` (the rank's role in the step; it runs the user's step,
and the model's calls of the pipelined blocks reach it through ``block_calls``, which checks them as a chain with
``call_order`` and answers them with ``placeholders``) -> ``engine`` (``execute``: the schedule's actions, one
handler per kind, each forward handed to its caller; messages taken from ``inboxes``, each chunk's graph cut at ``chunk_graph``, forwards re-run by
``recomputation``) -> ``stage`` (the blocks this rank holds, run on a micro-batch). Beside them: messages between
stages (``p2p``), the process groups (``process_groups``), gradients across processes (``gradients``, ``tied``), the
split backward, random streams, BatchNorm over the whole batch, ``torch.compile`` per stage (``compiling``), a
meta-device model made real (``materialize``), the last stage's logs replayed on the others (``replayed_logs``) and what
a micro-batch's loss averages over (``loss_items``).

May import: ``schedules``, ``partition``, ``reliability``, ``trace``. Imported by ``checkpoints``,
``integration`` and the strategy.
"""
