"""How the model and the batch are split: which blocks to pipeline and which stage holds each, into micro-batches.

Holds: the stage and micro-batch counts and their even split of the blocks (``counts``: ``PipelineParallelConfig``),
finding the region (``region``, ``step_probe``, ``hooks``, ``meta_run``), where the outside modules run
(``placement``), the split into stages (``balance``, measured by ``profiling`` or, without weights, estimated by
``memory_estimate``; a tensor-parallel rank's slice of a block by ``tensor_slices``), the batch into micro-batches (``microbatch``), which rank runs which stage (``topology``) and
the check that every rank built the same model (``fingerprint``). Pure logic and meta-device runs: nothing here
needs a process group.

May import: ``schedules``. Imported by everything above it (docs/architecture.md).
"""
