"""The training step run on the shapes of the first training batch, to see which modules it calls one after another.

The blocks to pipeline are found in the model's containers and in what its ``forward`` calls; when those leave much of
the model outside the pipeline, the strategy also looks at what ``training_step`` calls (Lightning's README
autoencoder calls ``self.encoder`` then ``self.decoder`` from its step; its ``forward`` calls the encoder only). The
step then runs once at start-up, on every rank alike: on the meta device (through
:func:`lightning_pipe.partition.region.observed_chains`), with ``self.log`` and ``self.log_dict`` doing nothing, on the
first batch of the training DataLoader moved to the meta device. Neither taking the batch nor the step's run changes
the random state that training then starts from.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from lightning.fabric.utilities.seed import _collect_rng_states, _set_rng_states
from torch import nn


@contextlib.contextmanager
def random_state_kept() -> Iterator[None]:
    """Whatever runs inside draws no number that the code after it would have drawn."""
    states = _collect_rng_states(include_cuda=torch.cuda.is_available())
    try:
        yield
    finally:
        _set_rng_states(states)


def first_training_batch(
    trainer: Any, module: nn.Module, device: torch.device = torch.device("meta"), loaders: Any = None
) -> Any | None:
    """The first batch of the training DataLoader, through the module's batch hooks, on ``device`` (by default the
    meta device: its shapes only); ``None`` when there is no training DataLoader or it cannot be read here. Before
    the fit attaches its data (the check before the processes start): ``loaders``, the ``train_dataloaders`` given
    to ``trainer.fit``, where it is one loader (a DataModule's ``setup`` has not run yet), else the module's own
    ``train_dataloader``, if it has one."""
    source = trainer.fit_loop._data_source
    try:
        try:
            loader = source.dataloader()
        except Exception:  # not attached yet: Lightning's own hook, where the module defines none, raises too
            loader = loaders if _one_loader(loaders) else module.train_dataloader()
        batch = next(iter(loader))
        batch = module._on_before_batch_transfer(batch, 0)
        return module._apply_batch_transfer_handler(batch, device, 0)
    except Exception:  # an unusual loader or hook: the region is found without the step
        return None


def _one_loader(loaders: Any) -> bool:
    """Whether ``loaders`` is one iterable of batches: not a DataModule, nor a collection of loaders."""
    return (isinstance(loaders, Iterable) and not isinstance(loaders, (Mapping, list, tuple))
            and not hasattr(loaders, "train_dataloader"))


def fit_training_step(module: nn.Module) -> Callable[[nn.Module], Any] | None:
    """During a fit, the training step on the first training batch's shapes (:func:`first_batch_step`); ``None``
    outside a fit (``TrainerFn.FITTING``) or where the batch cannot be read."""
    trainer = getattr(module, "_trainer", None)
    if trainer is None or trainer.state.fn != "fit":
        return None
    return first_batch_step(trainer, module)


def first_batch_step(trainer: Any, module: nn.Module, loaders: Any = None) -> Callable[[nn.Module], Any] | None:
    """The training step on the first training batch's shapes (:func:`training_step_on`), the batch read with the
    random state kept (``loaders``: see :func:`first_training_batch`); ``None`` where the batch cannot be read."""
    with random_state_kept():
        batch = first_training_batch(trainer, module, loaders=loaders)
    return None if batch is None else training_step_on(batch)


def training_step_on(batch: Any) -> Callable[[nn.Module], Any]:
    """What runs ``module.training_step(batch, 0)`` with logging turned off."""

    def step(module: nn.Module) -> Any:
        module.log = module.log_dict = _log_nothing  # type: ignore[method-assign]
        try:
            return module.training_step(batch, 0)  # type: ignore[operator]
        finally:
            del module.log, module.log_dict

    return step


def _log_nothing(*args: Any, **kwargs: Any) -> None:
    pass
