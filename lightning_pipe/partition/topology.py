"""Where each stage runs: the layout of global ranks over pipeline stages, data-parallel replicas and the
tensor-parallel ranks of a stage.

Ranks form a ``(pipeline, replica, tensor)`` grid, pipeline outermost and tensor-parallel innermost by default (as in
torchtitan and Megatron), so that a stage's tensor-parallel ranks, which talk in every block, sit on one node, a
replica's gradient all-reduce stays among neighbouring ranks while activations cross nodes. Grid row 0, and so global
rank 0, holds the stage with the model's last chunk, where the loss, the metrics and the step outputs live, which is
where Lightning's loggers, progress bar and rank-zero callbacks look for them: the *last* stage, so the stages run
backwards along the pipeline dimension, or, for a schedule whose chunks go down the stages and back up (``zbv``), the
first.

A *pipeline* is the ``num_stages`` ranks of one replica and one tensor-parallel index: activations travel along it,
between ranks of the same tensor-parallel index.
"""

from __future__ import annotations

from dataclasses import dataclass

# The grid's dimensions by their names in ``mesh_order``: pipeline, data-parallel replicas, tensor-parallel.
DIMENSIONS = ("pp", "dp", "tp")


@dataclass(frozen=True)
class PipelineLayout:
    """``num_stages * num_replicas * tensor_parallel`` ranks, each holding one stage of one replica of the pipeline
    (its ``1 / tensor_parallel`` of the stage's tensor-parallel blocks)."""

    num_stages: int
    num_replicas: int = 1
    pipeline_outermost: bool = True  # False: the stages of one pipeline sit on neighbouring ranks
    loss_on_first_stage: bool = False  # the model's last chunk is on stage 0 (a V placement)
    tensor_parallel: int = 1  # ranks splitting each stage's blocks (tensor parallelism)
    tensor_parallel_innermost: bool = True  # False: the tensor-parallel dimension outermost

    @property
    def loss_stage(self) -> int:
        """The stage that holds the model's last chunk: the loss, and global rank 0."""
        return 0 if self.loss_on_first_stage else self.num_stages - 1

    def _row(self, stage: int) -> int:
        """The pipeline coordinate of ``stage``: the loss stage first (an involution: also the stage of a row)."""
        return stage if self.loss_on_first_stage else self.num_stages - 1 - stage

    @property
    def order(self) -> tuple[str, str, str]:
        """The grid's dimensions, outermost first."""
        pipeline_and_replicas = ("pp", "dp") if self.pipeline_outermost else ("dp", "pp")
        if self.tensor_parallel_innermost:
            return (*pipeline_and_replicas, "tp")
        return ("tp", *pipeline_and_replicas)

    @property
    def sizes(self) -> dict[str, int]:
        return {"pp": self.num_stages, "dp": self.num_replicas, "tp": self.tensor_parallel}

    @property
    def world_size(self) -> int:
        return self.num_stages * self.num_replicas * self.tensor_parallel

    def rank(self, stage: int, replica: int = 0, tensor: int = 0) -> int:
        """Global rank holding ``stage`` of ``replica`` at tensor-parallel index ``tensor``."""
        coordinates, sizes, rank = {"pp": self._row(stage), "dp": replica, "tp": tensor}, self.sizes, 0
        for name in self.order:
            rank = rank * sizes[name] + coordinates[name]
        return rank

    def _coordinates(self, rank: int) -> dict[str, int]:
        coordinates, sizes = {}, self.sizes
        for name in reversed(self.order):
            rank, coordinates[name] = divmod(rank, sizes[name])
        return coordinates

    def stage(self, rank: int) -> int:
        return self._row(self._coordinates(rank)["pp"])

    def replica(self, rank: int) -> int:
        return self._coordinates(rank)["dp"]

    def tensor_index(self, rank: int) -> int:
        """The tensor-parallel index of ``rank`` (which slice of its stage's tensor-parallel blocks it holds)."""
        return self._coordinates(rank)["tp"]

    def pipelines(self) -> list[tuple[int, int]]:
        """Every pipeline, as ``(replica, tensor-parallel index)``, in one order on every rank."""
        return [(replica, tensor) for replica in range(self.num_replicas) for tensor in range(self.tensor_parallel)]

    def pipeline_ranks(self, replica: int, tensor: int = 0) -> list[int]:
        """The ranks of one pipeline, ordered by stage (first stage first)."""
        return [self.rank(stage, replica, tensor) for stage in range(self.num_stages)]

    def replica_ranks(self, stage: int, tensor: int = 0) -> list[int]:
        """The ranks holding ``stage`` at tensor-parallel index ``tensor``, one per replica: they average their
        gradients."""
        return [self.rank(stage, replica, tensor) for replica in range(self.num_replicas)]

    def tensor_parallel_ranks(self, stage: int, replica: int = 0) -> list[int]:
        """The ranks splitting ``stage`` of ``replica`` between them, by tensor-parallel index."""
        return [self.rank(stage, replica, tensor) for tensor in range(self.tensor_parallel)]
