"""What runs on every rank of a benchmark: one module per measurement (each started by
:func:`harness.launch.launch` as ``python -m ranks.MODULE``), and the training steps they time."""
