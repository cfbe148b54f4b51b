"""The pipeline's counts: how many stages, how many micro-batches per batch, and the even split of blocks into stages."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PipelineParallelConfig:
    """Configuration for pipeline-parallel training.

    Pipeline parallelism partitions a model's sequential blocks into ``num_stages`` stages, each on its own device
    and process. During training every mini-batch is split into ``num_micro_batches`` micro-batches that flow
    through the stages concurrently (GPipe scheduling), which shrinks the idle "bubble" of a naive pipeline to a
    fraction ``(S - 1) / (M + S - 1)`` of the step.

    Use :meth:`split_into_stages` to compute the block range of each stage.
    """

    num_stages: int
    """Number of pipeline stages, one per process. More stages fit a bigger model but add bubble time."""

    num_micro_batches: int
    """Number of micro-batches per mini-batch. More shrink the bubble (negligible at ``M >= 4 * num_stages``) but
    make each micro-batch, and so each matrix product, smaller."""

    def __post_init__(self) -> None:
        require_positive_int("num_stages", self.num_stages)
        require_positive_int("num_micro_batches", self.num_micro_batches)

    def split_into_stages(self, num_blocks: int | None = None, *, num_layers: int | None = None) -> list[range]:
        """Contiguous block ranges, one per stage, covering every block once; sizes differ by at most one.
        (``num_layers``: the former name of ``num_blocks``, still taken, with a ``DeprecationWarning``.)

        >>> PipelineParallelConfig(num_stages=3, num_micro_batches=4).split_into_stages(8)
        [range(0, 3), range(3, 6), range(6, 8)]
        """
        if num_layers is not None:
            if num_blocks is not None:
                raise TypeError("split_into_stages() takes num_blocks or its former name num_layers, not both")
            warnings.warn("split_into_stages(num_layers=...) is now split_into_stages(num_blocks=...)",
                          DeprecationWarning, stacklevel=2)
            num_blocks = num_layers
        require_positive_int("num_blocks", num_blocks)
        return split_evenly(num_blocks, self.num_stages)  # type: ignore[arg-type]


def require_positive_int(name: str, value: object) -> None:
    """Raise unless ``value`` is an integer of at least 1; ``name`` is the setting as the user wrote it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is invalid; it must be a positive integer (1 or more).")


def split_evenly(num_blocks: int, num_stages: int) -> list[range]:
    """Contiguous block ranges, one per stage, covering every block once; sizes differ by at most one, the larger
    ones first.

    >>> split_evenly(8, 3)
    [range(0, 3), range(3, 6), range(6, 8)]
    """
    check_stage_count(num_blocks, num_stages)
    base, extra = divmod(num_blocks, num_stages)
    return ranges_from_sizes([base + 1 if stage < extra else base for stage in range(num_stages)])


def check_stage_count(num_blocks: int, num_stages: int) -> None:
    """Raise, naming the limit, unless every one of ``num_stages`` stages can get a block."""
    if num_stages > num_blocks:
        raise ValueError(
            f"num_stages={num_stages} but the pipelined module has only {num_blocks} block{_s(num_blocks)};"
            f" use at most {num_blocks} stage{_s(num_blocks)}, or split the model into more blocks."
            if num_blocks > 0
            else "the pipelined module has no blocks; pipeline a module that holds the blocks to split."
        )


def _s(count: int) -> str:
    return "" if count == 1 else "s"


def ranges_from_sizes(sizes: Sequence[int]) -> list[range]:
    """Turn per-stage block counts such as ``[3, 5]`` into contiguous ranges ``[range(0, 3), range(3, 8)]``."""
    ranges, start = [], 0
    for size in sizes:
        ranges.append(range(start, start + size))
        start += size
    return ranges
