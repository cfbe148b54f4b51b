"""Lightning's model summary under the pipeline: the model as it was built, with where each of its layers runs.

Lightning's ``ModelSummary`` (and ``RichModelSummary``) callback summarises the LightningModule at the start of
``fit`` on global rank 0, the last stage. There the other stages' blocks are stand-ins without parameters; while the
callback builds its summary, :meth:`~lightning_pipe.execution.stage.StageBlocks.showing_whole_model` puts the blocks
back, so the table lists the real types and parameter counts, and a last column says which stage runs each layer;
with the stages sharded over their replicas (``data_parallel="shard"`` / ``"full_shard"``), which part each rank
holds: ``stage 1, 1/2 per rank`` (tied parameters and what every stage holds stay whole).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_pipe.execution.stage import StageBlocks

STAGE_COLUMN = "Runs on"
EVERY_STAGE = "every stage"


@dataclass(frozen=True)
class WholeModelSummary:
    """What Lightning's summary callbacks read of a summary, taken while the whole model was in place."""

    summary_data: list[tuple[str, list[str]]]
    total_parameters: int
    trainable_parameters: int
    model_size: float
    total_training_modes: dict[str, int]
    total_flops: int

    def _get_summary_data(self) -> list[tuple[str, list[str]]]:
        return self.summary_data


def summarize_whole_model(
    callbacks: Sequence[Any],
    stage: StageBlocks,
    ranges: Sequence[Sequence[int]],
    outside: Mapping[str, str] = {},
    showing_outside: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    sharded_over: int = 1,
) -> Callable[[], None]:
    """Make Lightning's model summary callbacks among ``callbacks`` summarise the whole model, each row with the
    stages that run it (``ranges``: the blocks of each stage; ``outside``: where each module outside them lives,
    ``showing_outside`` puts back those this stage does not hold; ``sharded_over``: the replicas each stage is sharded
    over, 1 for none); returns what undoes it."""
    wrapped = [callback for callback in callbacks if _is_model_summary(callback)]
    for callback in wrapped:
        callback._summary = _whole_model_summary(callback._summary, stage, ranges, outside, showing_outside,
                                                 sharded_over)

    def undo() -> None:
        for callback in wrapped:
            callback.__dict__.pop("_summary", None)

    return undo


def _whole_model_summary(
    summary: Callable[..., Any],
    stage: StageBlocks,
    ranges: Sequence[Sequence[int]],
    outside: Mapping[str, str],
    showing_outside: Callable[[], contextlib.AbstractContextManager],
    sharded_over: int = 1,
) -> Callable[..., Any]:
    def whole(trainer: Any, module: nn.Module) -> WholeModelSummary:
        with stage.showing_whole_model(), showing_outside():
            lightning_summary = summary(trainer, module)
            data = lightning_summary._get_summary_data()
            names = dict(data)["Name"]
            where = [where_it_runs(module, name, stage, ranges, outside) for name in names]
            if sharded_over > 1:
                where = [held_per_rank(row, sharded_over) for row in where]
            data.append((STAGE_COLUMN, where))
            return WholeModelSummary(
                data,
                lightning_summary.total_parameters,
                lightning_summary.trainable_parameters,
                lightning_summary.model_size,
                lightning_summary.total_training_modes,
                getattr(lightning_summary, "total_flops", 0),
            )

    return whole


def where_it_runs(
    model: nn.Module, name: str, stage: StageBlocks, ranges: Sequence[Sequence[int]], outside: Mapping[str, str] = {}
) -> str:
    """``"stage 1"`` for a pipelined block and what it holds, ``"stages 0-1"`` for a module made of the blocks of
    several stages, where an outside module lives (``outside``: ``"stage 0"``, ``"stages 0, 3"``) and ``"every
    stage"`` for what every stage holds."""
    for module_name, where in outside.items():
        if name == module_name or name.startswith(module_name + "."):
            return where
    stage_of = {block: s for s, blocks in enumerate(ranges) for block in (stage.region.names[i] for i in blocks)}
    for block, s in stage_of.items():
        if name == block or name.startswith(block + "."):
            return f"stage {s}"
    try:
        module = model.get_submodule(name)
    except AttributeError:  # not a module: Lightning's row of the parameters outside every module
        return EVERY_STAGE
    inside = {block: s for block, s in stage_of.items() if block.startswith(name + ".")}
    holds_outside = any(
        not any(f"{name}.{parameter}".startswith(block + ".") for block in inside)
        for parameter, _ in module.named_parameters()
    )
    if not inside or holds_outside:
        return EVERY_STAGE
    first, last = min(inside.values()), max(inside.values())
    return f"stage {first}" if first == last else f"stages {first}-{last}"


def held_per_rank(where: str, replicas: int) -> str:
    """``where`` with the share each rank of a stage sharded over ``replicas`` holds: a module of one stage, or of
    consecutive stages' blocks, is sharded; one that several stages hold apart (tied) or every stage is whole."""
    if where == EVERY_STAGE or "," in where:
        return f"{where}, whole"
    return f"{where}, 1/{replicas} per rank"


def _is_model_summary(callback: Any) -> bool:
    """Lightning's ``ModelSummary`` callback or a subclass (``RichModelSummary``), of either Lightning package."""
    return any(
        cls.__name__ == "ModelSummary" and cls.__module__.endswith("callbacks.model_summary")
        for cls in type(callback).__mro__
    )
