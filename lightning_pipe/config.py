"""The pipeline-parallel configuration: how many stages, and how many micro-batches per batch."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_pipe.balance import split_evenly


@dataclass(frozen=True)
class PipelineParallelConfig:
    """Configuration for pipeline-parallel training.

    Pipeline parallelism partitions a model's sequential layers into ``num_stages`` stages, each on its own device
    and process. During training every mini-batch is split into ``num_micro_batches`` micro-batches that flow
    through the stages concurrently (GPipe scheduling), which shrinks the idle "bubble" of a naive pipeline to a
    fraction ``(S - 1) / (M + S - 1)`` of the step.

    Use :meth:`split_into_stages` to compute the layer range of each stage.
    """

    num_stages: int
    """Number of pipeline stages, one per process. More stages fit a bigger model but add bubble time."""

    num_micro_batches: int
    """Number of micro-batches per mini-batch. More shrink the bubble (negligible at ``M >= 4 * num_stages``) but
    make each micro-batch, and so each matrix product, smaller."""

    def __post_init__(self) -> None:
        require_positive_int("num_stages", self.num_stages)
        require_positive_int("num_micro_batches", self.num_micro_batches)

    def split_into_stages(self, num_layers: int) -> list[range]:
        """Contiguous layer ranges, one per stage, covering every layer once; sizes differ by at most one.

        >>> PipelineParallelConfig(num_stages=3, num_micro_batches=4).split_into_stages(8)
        [range(0, 3), range(3, 6), range(6, 8)]
        """
        require_positive_int("num_layers", num_layers)
        return split_evenly(num_layers, self.num_stages)


def require_positive_int(name: str, value: object) -> None:
    """Raise unless ``value`` is an integer of at least 1; ``name`` is the setting as the user wrote it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is invalid; it must be a positive integer (1 or more).")
