"""What the last stage logs, every stage logs: records ``self.log`` calls on the last stage and replays them elsewhere.

The last stage's outcome of each step also carries its metric states and its random state, which the other stages
adopt, so that every stage continues from the same point.

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
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torchmetrics import Metric


@dataclass
class LogRecord:
    """One ``self.log`` call: its name, its value (on the CPU, detached) and its other arguments.

    A logged torchmetrics ``Metric`` travels as its value for this batch plus the name of its attribute: the
    replay logs the receiving stage's own metric object, whose state the epoch end makes equal to the last stage's.
    """

    name: str
    value: Any
    kwargs: dict[str, Any]
    metric_attribute: str | None = None


@dataclass
class StepOutcome:
    """What the last stage tells the other stages after the user's step (or hook) ran."""

    skipped: bool = False  # the step returned None: no backward, as on one device
    loss: float | None = None
    logs: list[LogRecord] = field(default_factory=list)
    metric_states: dict[str, MetricState] | None = None  # at epoch ends: every metric's accumulated state
    random_states: dict[str, Any] | None = None  # the last stage's random generators, for every stage to adopt
    requeue: bool = False  # the last stage was told to requeue (SLURM's SIGUSR1): every stage does at the next step


@contextlib.contextmanager
def recording_logs(module: LightningModule, log: bool = True) -> Iterator[list[LogRecord]]:
    """Within the block, every ``module.log`` call (``log_dict`` included) is recorded into the yielded list, and
    logged as usual unless ``log`` is false (see :func:`merged_logs`)."""
    records: list[LogRecord] = []
    original_log = module.log

    def recorded_log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if log:
            original_log(name, value, *args, **kwargs)
        kwargs.pop("sync_dist_group", None)  # a process group cannot travel; replays use the strategy's group
        attribute = None
        if isinstance(value, Metric):
            attribute = kwargs.pop("metric_attribute", None) or _attribute_of(module, value)
        records.append(LogRecord(name, _portable(value), _named_arguments(args, kwargs), attribute))

    module.log = recorded_log  # type: ignore[method-assign]
    try:
        yield records
    finally:
        del module.log  # the instance attribute shadowed the class's method


def merged_logs(records: dict[int, list[LogRecord]], weights: dict[int, float]) -> list[LogRecord]:
    """The ``self.log`` calls of one step that ran once per micro-batch (``records`` and ``weights`` by micro-batch),
    as one step's calls: each name's values averaged with the micro-batches' weights (their shares of the batch), so
    that a mean over samples comes out as one device computes it on the whole batch. A logged metric's value for the
    batch is merged the same way; its state already holds every micro-batch's update."""
    merged: dict[str, LogRecord] = {}
    values: dict[str, list[tuple[float, Any]]] = {}
    for m in sorted(records):
        for record in records[m]:
            merged.setdefault(record.name, record)
            values.setdefault(record.name, []).append((weights[m], record.value))
    result = []
    for name, record in merged.items():
        pairs = values[name]
        total = sum(weight for weight, _ in pairs)
        if all(isinstance(value, (Tensor, numbers.Number)) and not isinstance(value, bool) for _, value in pairs):
            value = sum(weight * value for weight, value in pairs) / total
        else:
            value = pairs[-1][1]  # not a number: the last micro-batch's
        result.append(LogRecord(name, value, record.kwargs, record.metric_attribute))
    return result


def merged_output(results: dict[int, Any], weights: dict[int, float]) -> Any:
    """What a training step that ran once per micro-batch returns for the whole batch: ``None`` if every
    micro-batch's step did; else the loss (or ``{"loss": ..., ...}``) averaged with the weights of the micro-batches
    that returned one, detached (its backward has run), other dict entries merged alike when they are numbers,
    joined along dim 0 when they are batches, else the last micro-batch's."""
    returned = {m: result for m, result in results.items() if result is not None}
    if not returned:
        return None
    first = next(iter(returned.values()))
    if isinstance(first, Tensor):
        return sum(weights[m] * result.detach() for m, result in returned.items())
    merged = {}
    for key in first:
        items = [(weights[m], result[key]) for m, result in returned.items()]
        if key == "loss" or all(isinstance(v, Tensor) and v.dim() == 0 for _, v in items):
            merged[key] = sum(weight * value.detach() for weight, value in items)
        elif all(isinstance(v, Tensor) for _, v in items):
            merged[key] = torch.cat([value.detach() for _, value in items])
        else:
            merged[key] = items[-1][1]
    return merged


def replay_logs(module: LightningModule, records: list[LogRecord]) -> None:
    """Log the recorded values on this rank, in the current hook, with the original arguments."""
    for record in records:
        value = apply_to_collection(record.value, Tensor, lambda t: t.to(module.device))
        if record.metric_attribute is not None:
            metric = module.get_submodule(record.metric_attribute)
            metric._forward_cache = value
            module.log(record.name, metric, metric_attribute=record.metric_attribute, **record.kwargs)
        else:
            module.log(record.name, value, **record.kwargs)


# A metric's accumulated state: its state tensors (or lists of tensors, on the CPU) and its update count.
MetricState = tuple[dict[str, Any], int]


def metric_states(module: LightningModule, names: set[str] | None = None) -> dict[str, MetricState]:
    """The accumulated state of the torchmetrics ``Metric`` objects in ``module`` (those in ``names``, or all)."""
    return {
        name: ({key: _to(getattr(metric, key), "cpu") for key in metric._defaults}, metric._update_count)
        for name, metric in module.named_modules()
        if isinstance(metric, Metric) and (names is None or name in names)
    }


def logged_metric_states(module: LightningModule, records: list[LogRecord]) -> dict[str, MetricState] | None:
    """The states of the metric objects logged in ``records``.

    Lightning may compute a metric's epoch value right after the last step of a loop (before any epoch-end hook),
    so the other stages' copies must already hold the last stage's state by then.
    """
    names = {record.metric_attribute for record in records if record.metric_attribute is not None}
    return metric_states(module, names) if names else None


def load_metric_states(module: LightningModule, states: dict[str, MetricState]) -> None:
    """Give this stage's metrics the last stage's state, so that ``compute()`` returns the same value here."""
    for name, (state, update_count) in states.items():
        metric = module.get_submodule(name)
        for key, value in state.items():
            setattr(metric, key, _to(value, module.device))
        metric._update_count = update_count
        metric._computed = None


def random_states(device: torch.device) -> dict[str, Any]:
    """The process's random generators (torch, its accelerator's, numpy, Python), as Lightning collects them. The
    generators' tensor states are plain bytes here: a pickled tensor goes through ``torch.save`` and ``torch.load``,
    which cost the receiving stages more than the rest of the step's outcome (about 0.25 ms a step)."""
    states = _collect_rng_states(include_cuda=False)
    if device.type == "cuda":
        states["cuda_device"] = torch.cuda.get_rng_state(device)
    return {key: bytes(state.numpy()) if isinstance(state, Tensor) else state for key, state in states.items()}


def adopt_random_states(states: dict[str, Any], device: torch.device) -> None:
    """Continue from another stage's random state.

    Every stage runs the user's code before the pipelined call on the same batch; random numbers drawn there
    (augmentation, noise, a permutation of the batch), the sampler's next shuffle and the data workers' seeds must
    agree across stages, even though the stages' blocks (their dropout) drew different amounts of randomness.
    """
    states = {key: _byte_tensor(state) if isinstance(state, bytes) else state for key, state in states.items()}
    cuda_state = states.pop("cuda_device", None)
    _set_rng_states(states)
    if cuda_state is not None and device.type == "cuda":
        torch.cuda.set_rng_state(cuda_state, device)


def _byte_tensor(state: bytes) -> Tensor:
    """A generator's state as the ``torch.uint8`` tensor its setter takes (see :func:`random_states`)."""
    return torch.frombuffer(bytearray(state), dtype=torch.uint8)


def _to(value: Any, device: torch.device | str) -> Any:
    return apply_to_collection(value, Tensor, lambda t: t.detach().to(device))


def _attribute_of(module: LightningModule, metric: Metric) -> str:
    for name, candidate in module.named_modules():
        if candidate is metric:
            return name
    raise ValueError(
        f"the logged metric {type(metric).__name__} is not an attribute of {type(module).__name__}; assign it to"
        " an attribute (e.g. `self.train_acc = Accuracy(...)`) so that every pipeline stage has its own copy."
    )


_LOG_POSITIONAL = ("prog_bar", "logger", "on_step", "on_epoch", "reduce_fx")


def _named_arguments(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    return {**dict(zip(_LOG_POSITIONAL, args)), **kwargs}


def _portable(value: Any) -> Any:
    """A picklable copy of a logged value; a torchmetrics ``Metric`` travels as its value for this batch."""
    if isinstance(value, Metric):
        value = value._forward_cache
    if value is None:
        return None
    if isinstance(value, Tensor):
        value = value.detach().to("cpu")
        # A pickled tensor carries its whole storage: torch's CPU `mse_loss` returns a view into the batch-sized
        # buffer it reduced (2 MiB for a 1024 x 512 batch), which every step's outcome would otherwise carry.
        dense = type(value) is Tensor and value.layout is torch.strided  # a storage of its own to compare with
        return value.clone() if dense and value.untyped_storage().nbytes() > value.nbytes else value
    if isinstance(value, numbers.Number):
        return value
    if isinstance(value, dict):
        return {key: _portable(item) for key, item in value.items()}
    return torch.as_tensor(value)
