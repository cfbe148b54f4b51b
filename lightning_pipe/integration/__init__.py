"""Lightning and Hydra around the pipeline: launchers, the two packages Lightning comes in, its model summary, Hydra.

Holds: launchers that check the model before any rank starts, start the process groups, hear a rank's signals and
end the ranks of a failed run (``launchers``),
what the strategy takes from ``lightning.pytorch`` or the standalone ``pytorch_lightning`` (``lightning_packages``),
Lightning's model summary of the whole model (``model_summary``), and the schema of the ``strategy`` config group
(``hydra_schema``).

May import: everything below it, ``settings`` included. Imported by the strategy, its ``pytorch_lightning`` twin
(``standalone``) and ``__init__``.
"""
