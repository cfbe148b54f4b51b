"""Deferred BatchNorm: running statistics over the whole mini-batch, as on one device, not per micro-batch.

In a pipeline every micro-batch passes through a BatchNorm layer separately, so by default BatchNorm normalises
each micro-batch with its own statistics and updates its running statistics once per micro-batch (GPipe's
semantics). With ``GPipeStrategy(deferred_batch_norm=True)`` (torchgpipe's option of the same name) each micro-batch
is still normalised with its own statistics, but the running statistics are updated once per mini-batch, from the
statistics of the whole mini-batch: after training they equal one device's.

A BatchNorm in training needs more than one value per channel. In a pipeline it sees a micro-batch, not the batch:
:func:`check_micro_batches_fit_batch_norm` tells before training when a micro-batch is too small for one of them,
from the shapes its inputs had in an observed forward (:func:`observed_batch_norm_inputs`), for the batches of the
step and for the epoch's smaller last batch (:func:`epoch_last_batch_size`).

The conversion swaps the class of each BatchNorm module in place (as ``torch.nn.utils.parametrize`` does), so
parameters, buffers, state-dict keys and optimizer references stay exactly as they were; :func:`revert` undoes it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils.data import BatchSampler

_ACCUMULATORS = ("_deferred_sum", "_deferred_squares", "_deferred_count")


class DeferredBatchNorm(_BatchNorm):
    """Mixed into a BatchNorm class: accumulate the statistics of every micro-batch, update once in :meth:`commit`."""

    def forward(self, input: Tensor) -> Tensor:
        if not (self.training and self.track_running_stats):
            return super().forward(input)
        self._check_input_dim(input)
        dims = [0, *range(2, input.dim())]
        with torch.no_grad():
            self._deferred_sum += input.sum(dims, dtype=torch.float32)
            self._deferred_squares += input.float().square().sum(dims)
            self._deferred_count += input.numel() // input.size(1)
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    @torch.no_grad()
    def commit(self) -> None:
        """Fold this mini-batch's statistics into the running statistics, once, as one device's BatchNorm would."""
        count = int(self._deferred_count)
        if not (self.training and self.track_running_stats) or count == 0:
            return
        mean = self._deferred_sum / count
        variance = (self._deferred_squares / count - mean.square()) * (count / max(count - 1, 1))
        self.num_batches_tracked.add_(1)
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        self.running_mean.mul_(1 - factor).add_(mean.to(self.running_mean.dtype), alpha=factor)
        self.running_var.mul_(1 - factor).add_(variance.to(self.running_var.dtype), alpha=factor)
        for name in _ACCUMULATORS:
            getattr(self, name).zero_()


_deferred_classes: dict[type, type] = {}  # BatchNorm class -> its deferred subclass


def defer(module: nn.Module) -> list[DeferredBatchNorm]:
    """Turn every BatchNorm in ``module`` into a deferred one, in place; return them."""
    converted = []
    for child in module.modules():
        if isinstance(child, _BatchNorm) and not isinstance(child, DeferredBatchNorm):
            base = type(child)
            if base not in _deferred_classes:
                _deferred_classes[base] = type(f"Deferred{base.__name__}", (DeferredBatchNorm, base), {})
            features = child.num_features
            device = child.weight.device if child.weight is not None else child.running_mean.device
            child.register_buffer("_deferred_sum", torch.zeros(features, device=device), persistent=False)
            child.register_buffer("_deferred_squares", torch.zeros(features, device=device), persistent=False)
            count = torch.zeros((), dtype=torch.int64, device=device)
            child.register_buffer("_deferred_count", count, persistent=False)
            child.__class__ = _deferred_classes[base]
            converted.append(child)
    return converted


def revert(module: nn.Module) -> None:
    """Give every deferred BatchNorm in ``module`` its original class back."""
    for child in module.modules():
        if isinstance(child, DeferredBatchNorm):
            for name in _ACCUMULATORS:
                delattr(child, name)
            # `isinstance`: a BatchNorm that is itself a pipelined block is of its deferred class's routed subclass
            # (lightning_pipe.execution.stage.routed_class) until the run puts the blocks back, just after.
            child.__class__ = next(base for base, deferred in _deferred_classes.items() if isinstance(child, deferred))


@contextmanager
def observed_batch_norm_inputs(layers: nn.Module, batch_size: int) -> Iterator[dict[str, float]]:
    """While open, record for every BatchNorm of ``layers`` (by its name there) that is called in a forward of
    ``batch_size`` samples how many values per channel each sample brings it: one for (N, C), H*W for (N, C, H, W).

    Only shapes are read, so the forward observed may run on the meta device.
    """
    values: dict[str, float] = {}
    handles = []
    for name, module in layers.named_modules():
        if isinstance(module, _BatchNorm):
            def record(module: nn.Module, args: tuple, name: str = name) -> None:
                shape = args[0].shape
                values[name] = math.prod(shape) / (shape[1] * batch_size)
            handles.append(module.register_forward_pre_hook(record))
    try:
        yield values
    finally:
        for handle in handles:
            handle.remove()


def check_micro_batches_fit_batch_norm(
    layers: nn.Module,
    values_per_sample: Mapping[str, float],
    batch_size: int,
    num_micro_batches: int,
    last_of_epoch: bool = False,
) -> None:
    """Raise a ``ValueError`` if a micro-batch of a ``batch_size`` batch leaves a BatchNorm of ``layers`` in training
    one value per channel, which it cannot normalise (torch raises in the middle of the step, on one stage).

    ``values_per_sample`` comes from :func:`observed_batch_norm_inputs`. The micro-batches of a batch differ in size
    by at most one (``microbatch.split``); the smallest decides. ``last_of_epoch``: the batch is the epoch's smaller
    last one (:func:`epoch_last_batch_size`), which ``drop_last=True`` leaves out.
    """
    chunks = max(1, min(num_micro_batches, batch_size))
    smallest = batch_size // chunks
    for name, module in layers.named_modules():
        if name not in values_per_sample or not isinstance(module, _BatchNorm):
            continue
        if not module.training and module.track_running_stats:
            continue  # it normalises with its running statistics: any size works
        per_sample = values_per_sample[name]
        if smallest * per_sample >= 2:
            continue
        samples_needed = math.ceil(2 / per_sample)  # per micro-batch
        layer = f"{type(module).__name__} layer {name!r}"
        brings = f"each sample brings it {_values(per_sample)} per channel"
        if last_of_epoch:
            holds, a_batch = "the epoch's last batch holds", f"the epoch's last batch of {_samples(batch_size)}"
            remedy = "Pass drop_last=True to the training DataLoader to leave that batch out, or use"
        else:
            holds, a_batch, remedy = "the batch holds", f"a batch of {_samples(batch_size)}", "Use"
        if batch_size * per_sample < 2:
            raise ValueError(
                f"{layer} gets {_values(batch_size * per_sample)} per channel in training: {holds}"
                f" {_samples(batch_size)} and {brings}; it cannot normalise that, on one device either. {remedy}"
                f" batches of at least {_samples(samples_needed)}"
                + ("." if last_of_epoch else " (or drop_last=True in the DataLoader when only the last batch is this"
                   " small).")
            )
        raise ValueError(
            f"{layer} would get {_values(smallest * per_sample)} per channel in training: {a_batch} in"
            f" num_micro_batches={num_micro_batches} gives micro-batches of {_samples(smallest)}, and {brings}."
            f" {remedy} num_micro_batches={batch_size // samples_needed} or fewer, or batches of at least"
            f" {_samples(samples_needed * num_micro_batches)}. deferred_batch_norm=True does not help: it defers only"
            " the running statistics, and each micro-batch is still normalised with its own."
        )


def epoch_last_batch_size(loader: object) -> int | None:
    """The size of the smaller last batch of each epoch of a ``DataLoader``; ``None`` when there is none or it cannot
    be told (``drop_last=True``, batches that divide the samples, an iterable dataset, no automatic batching).

    Under data parallelism Lightning gives the loader a ``DistributedSampler``: its length is this replica's share.
    """
    batch_sampler = getattr(loader, "batch_sampler", None)
    if not isinstance(batch_sampler, BatchSampler) or batch_sampler.drop_last:
        return None
    try:
        samples = len(batch_sampler.sampler)  # type: ignore[arg-type]
    except TypeError:  # a sampler without a length
        return None
    return samples % batch_sampler.batch_size or None


def _values(count: float) -> str:
    return f"{count:g} value" + ("" if count == 1 else "s")


def _samples(count: int) -> str:
    return f"{count} sample" + ("" if count == 1 else "s")


def epoch_last_batch_reached(trainer: Any) -> int | None:
    """The size of the training DataLoader's smaller last batch, if this fit reaches it: ``limit_train_batches`` or
    ``max_steps`` may end the epoch first (then a BatchNorm need not fit it; a later step checks any new size)."""
    loader = trainer.train_dataloader
    size = epoch_last_batch_size(loader)
    if size is None:
        return None
    batches = len(loader)
    if trainer.num_training_batches < batches:
        return None
    if trainer.max_steps != -1 and trainer.max_steps * trainer.accumulate_grad_batches < batches:
        return None
    return size
