"""Models built from scratch in ``configure_model()`` (no pretrained weights), as a new user writes them, and one run
of each, shared by tests/test_from_scratch.py and its worker.

``FromScratchLM``: a Hugging Face ``LlamaForCausalLM`` (untied) or ``GPT2LMHeadModel`` (head tied to the embedding)
built from a tiny config; under the gpipe strategy it is built on the meta device and initialised by its model's own
``_init_weights`` on the stage that runs it. ``ScaledClassifier``: a model of the user's own with a module that has no
``reset_parameters()`` (:class:`Gain`), initialised by :func:`init_gain` passed as ``init_module``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch import nn

import lightning_pipe
from helpers.deferred_models import DeferredClassifier, data
from helpers.stock_models import CausalLM, gpt2_config, llama_config

LAYERS = 4  # one block per stage on 4 stages
# Where each model's blocks are, in the LightningModule.
BLOCKS = {"llama": "model.model.layers", "gpt2": "model.transformer.h"}


class FromScratchLM(CausalLM):
    """A Hugging Face causal LM built in ``configure_model`` from its config: no pretrained weights."""

    def __init__(self, kind: str, **kwargs: Any) -> None:
        super().__init__(None, **kwargs)
        self.kind = kind

    def configure_model(self) -> None:
        from transformers import GPT2LMHeadModel, LlamaForCausalLM

        if self.model is not None:  # configure_model runs again for trainer.test/validate/predict
            return
        if self.kind == "llama":
            self.model = LlamaForCausalLM(llama_config(LAYERS))
        else:
            self.model = GPT2LMHeadModel(gpt2_config(LAYERS))
        lightning_pipe.init_weights(self)  # one device: the weights the gpipe strategy gives the meta-built model


class Gain(nn.Module):
    """A per-feature gain with no ``reset_parameters()``: on the meta device only ``init_module`` can fill it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def init_gain(name: str, module: nn.Module) -> None:
    """The user's rule: gains drawn around one, the other modules by their own ``reset_parameters()`` (the
    LightningModule, holding a parameter made in ``__init__``, has none: it keeps its values)."""
    if isinstance(module, Gain):
        nn.init.normal_(module.gain, mean=1.0, std=0.1)
    elif callable(getattr(module, "reset_parameters", None)):
        module.reset_parameters()


class ScaledClassifier(DeferredClassifier):
    """:class:`helpers.deferred_models.DeferredClassifier` with a :class:`Gain` after every linear layer."""

    def configure_model(self) -> None:
        if self.layers is not None:
            return
        blocks: list[nn.Module] = []
        for i in range(4):
            blocks += [nn.Linear(12 if i == 0 else self.width, self.width), Gain(self.width), nn.Tanh()]
        self.layers = nn.Sequential(*blocks)
        self.head = nn.Linear(self.width, 3)
        lightning_pipe.init_weights(self, init_module=init_gain)


MODELS: dict[str, Callable[[], LightningModule]] = {
    "llama": lambda: FromScratchLM("llama"),
    "gpt2": lambda: FromScratchLM("gpt2"),
    "scaled": lambda: ScaledClassifier(width=16),
}


class InitialState(Callback):
    def __init__(self) -> None:
        self.state: dict[str, torch.Tensor] = {}

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.state = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


def fit(model_kind: str, root: Path, **trainer_kwargs: Any) -> dict[str, Any]:
    """One epoch of ``model_kind``; the state each rank held when fit started and when it ended (another stage's
    tensors on the meta device), and the blocks this rank ran (under the gpipe strategy)."""
    seed_everything(0, verbose=False)
    initial = InitialState()
    trainer = Trainer(accelerator="cpu", max_epochs=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                      limit_val_batches=0, default_root_dir=root, callbacks=[initial], **trainer_kwargs)
    model = MODELS[model_kind]()
    loaders = (data(64, 0),) if model_kind == "scaled" else ()
    trainer.fit(model, *loaders)
    strategy = trainer.strategy
    held = None
    if isinstance(strategy, lightning_pipe.GPipeStrategy):
        held = next(list(row.blocks) for row in strategy.stage_summary().rows if row.rank == trainer.global_rank)
    return {
        "initial": initial.state,
        "final": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "held_blocks": held,
        "global_rank": trainer.global_rank,
    }
