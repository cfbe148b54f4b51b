"""What the last stage logs, every stage logs: records ``self.log`` calls on the last stage and replays them elsewhere.

Only the last stage runs the user's step to its end, so only it has the loss and the metrics. Lightning, though,
reads logged values on every rank (``ModelCheckpoint`` and ``EarlyStopping`` run everywhere and must decide alike).
Replaying the last stage's ``self.log`` calls, with the same arguments, in the same hook, on every other stage
gives every rank the same ``trainer.callback_metrics``, epoch aggregates and progress-bar values.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch import LightningModule
from torch import Tensor
from torchmetrics import Metric


@dataclass
class LogRecord:
    """One ``self.log`` call: its name, its value (on the CPU, detached) and its other arguments."""

    name: str
    value: Any
    kwargs: dict[str, Any]


@dataclass
class StepOutcome:
    """What the last stage tells the other stages after the user's step (or hook) ran."""

    skipped: bool = False  # the step returned None: no backward, as on one device
    loss: float | None = None
    logs: list[LogRecord] = field(default_factory=list)


@contextlib.contextmanager
def recording_logs(module: LightningModule) -> Iterator[list[LogRecord]]:
    """Within the block, every ``module.log`` call (``log_dict`` included) is also recorded into the yielded list."""
    records: list[LogRecord] = []
    original_log = module.log

    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        original_log(name, value, *args, **kwargs)
        kwargs.pop("sync_dist_group", None)  # a process group cannot travel; replays use the strategy's group
        if isinstance(value, Metric):
            kwargs.pop("metric_attribute", None)  # replayed as a tensor, not as the metric object
        records.append(LogRecord(name, _portable(value), _named_arguments(args, kwargs)))

    module.log = log  # type: ignore[method-assign]
    try:
        yield records
    finally:
        del module.log  # the instance attribute shadowed the class's method


def replay_logs(module: LightningModule, records: list[LogRecord]) -> None:
    """Log the recorded values on this rank, in the current hook, with the original arguments."""
    for record in records:
        value = record.value
        if isinstance(value, Tensor):
            value = value.to(module.device)
        module.log(record.name, value, **record.kwargs)


_LOG_POSITIONAL = ("prog_bar", "logger", "on_step", "on_epoch", "reduce_fx")


def _named_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    return {**dict(zip(_LOG_POSITIONAL, args)), **kwargs}


def _portable(value: Any) -> Any:
    """A picklable copy of a logged value; a torchmetrics ``Metric`` travels as its value for this batch."""
    if isinstance(value, Metric):
        value = value._forward_cache
    if isinstance(value, Tensor):
        return value.detach().to("cpu")
    if isinstance(value, numbers.Number):
        return value
    if isinstance(value, dict):
        return {key: _portable(item) for key, item in value.items()}
    return torch.as_tensor(value)
