"""Where each stage runs: the layout of global ranks over pipeline stages and data-parallel replicas.

Ranks form a ``(pipeline, replica)`` grid, pipeline outermost (as in torchtitan and Megatron), so that a replica's
gradient all-reduce stays among neighbouring ranks (one node) while activations cross nodes. Grid row 0, and so
global rank 0, holds the stage with the model's last chunk, where the loss, the metrics and the step outputs live,
which is where Lightning's loggers, progress bar and rank-zero callbacks look for them: the *last* stage, so the
stages run backwards along the pipeline dimension, or, for a schedule whose chunks go down the stages and back up
(``zbv``), the first.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineLayout:
    """``num_stages * num_replicas`` ranks, each holding one stage of one replica of the pipeline."""

    num_stages: int
    num_replicas: int = 1
    pipeline_outermost: bool = True  # False: the stages of one pipeline sit on neighbouring ranks
    loss_on_first_stage: bool = False  # the model's last chunk is on stage 0 (a V placement)

    @property
    def loss_stage(self) -> int:
        """The stage that holds the model's last chunk: the loss, and global rank 0."""
        return 0 if self.loss_on_first_stage else self.num_stages - 1

    def _row(self, stage: int) -> int:
        """The pipeline coordinate of ``stage``: the loss stage first (an involution: also the stage of a row)."""
        return stage if self.loss_on_first_stage else self.num_stages - 1 - stage

    @property
    def world_size(self) -> int:
        return self.num_stages * self.num_replicas

    def rank(self, stage: int, replica: int = 0) -> int:
        """Global rank holding ``stage`` of ``replica``."""
        row = self._row(stage)
        if self.pipeline_outermost:
            return row * self.num_replicas + replica
        return replica * self.num_stages + row

    def stage(self, rank: int) -> int:
        row = rank // self.num_replicas if self.pipeline_outermost else rank % self.num_stages
        return self._row(row)

    def replica(self, rank: int) -> int:
        return rank % self.num_replicas if self.pipeline_outermost else rank // self.num_stages

    def pipeline_ranks(self, replica: int) -> list[int]:
        """The ranks of one pipeline, ordered by stage (first stage first)."""
        return [self.rank(stage, replica) for stage in range(self.num_stages)]

    def replica_ranks(self, stage: int) -> list[int]:
        """The ranks holding ``stage``, one per replica: they average their gradients."""
        return [self.rank(stage, replica) for replica in range(self.num_replicas)]
