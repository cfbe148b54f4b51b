"""One rank running its stage: the step runtime, the engine that executes the schedule, and the stage's blocks.

Holds what a training step descends through: strategy -> ``runtime`` (the rank's role in the step) -> ``engine``
(the schedule's actions) -> ``stage`` (the blocks this rank holds). Beside them: messages between stages (``p2p``), the process groups
(``process_groups``), gradients across processes (``gradients``, ``tied``), the split backward, random streams,
BatchNorm over the whole batch, ``torch.compile`` per stage (``compiling``), a meta-device model made real
(``materialize``) and the last stage's logs replayed on the others (``replayed_logs``).

May import: ``config``, ``schedules``, ``partition``, ``reliability``, ``trace``. Imported by ``checkpoints``,
``integration`` and the strategy.
"""
