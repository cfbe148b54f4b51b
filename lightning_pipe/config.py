"""The pipeline-parallel configuration: how many stages, how many micro-batches, and which layers each stage gets."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

CheckpointMode = Literal["always", "except_last", "never"]
CHECKPOINT_MODES: tuple[str, ...] = get_args(CheckpointMode)


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
        _require_positive_int("num_stages", self.num_stages)
        _require_positive_int("num_micro_batches", self.num_micro_batches)

    def split_into_stages(self, num_layers: int) -> list[range]:
        """Contiguous layer ranges, one per stage, covering every layer once; sizes differ by at most one.

        >>> PipelineParallelConfig(num_stages=3, num_micro_batches=4).split_into_stages(8)
        [range(0, 3), range(3, 6), range(6, 8)]
        """
        _require_positive_int("num_layers", num_layers)
        if self.num_stages > num_layers:
            raise ValueError(
                f"num_stages={self.num_stages} but the pipelined module has only {num_layers} layers;"
                f" use at most {num_layers} stages, or split the model into more layers."
            )
        base, extra = divmod(num_layers, self.num_stages)
        sizes = [base + 1 if stage < extra else base for stage in range(self.num_stages)]
        return ranges_from_sizes(sizes)


def ranges_from_sizes(sizes: list[int]) -> list[range]:
    """Turn per-stage layer counts such as ``[3, 5]`` into contiguous ranges ``[range(0, 3), range(3, 8)]``."""
    ranges, start = [], 0
    for size in sizes:
        ranges.append(range(start, start + size))
        start += size
    return ranges


def counts_from_config(
    config: PipelineParallelConfig | Mapping[str, Any], num_micro_batches: int | None
) -> tuple[int | None, int | None]:
    """``(num_stages, num_micro_batches)`` from a config object or mapping (a Hydra/OmegaConf node)."""
    if num_micro_batches is not None:
        raise ValueError("pass num_micro_batches inside the config, or pass both counts as plain integers, not both.")
    if isinstance(config, PipelineParallelConfig):
        return config.num_stages, config.num_micro_batches
    unknown = set(config) - {"num_stages", "num_micro_batches"}
    if unknown:
        raise ValueError(
            f"unknown pipeline config keys {sorted(unknown)}; a pipeline config holds num_stages and num_micro_batches."
        )
    return config.get("num_stages"), config.get("num_micro_batches")


def validate_checkpoint_mode(mode: str) -> CheckpointMode:
    """``mode`` if it is a known activation-checkpointing mode; else a ``ValueError`` naming the choices."""
    if mode not in CHECKPOINT_MODES:
        raise ValueError(
            f"checkpoint={mode!r} is not a checkpoint mode; use one of {', '.join(map(repr, CHECKPOINT_MODES))}"
            " ('except_last' re-computes every micro-batch's forward in backward except the last one)."
        )
    return mode  # type: ignore[return-value]


def _require_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} is invalid; it must be a positive integer (1 or more).")
