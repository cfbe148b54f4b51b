"""One rank of the pretrained-weights section (:mod:`sections.bench_pretrained`): a Llama saved as sharded safetensors
fine-tuned in float32 for a few steps, its weights read per stage (``GPipeStrategy(pretrained=...)``) or with
``from_pretrained`` in ``__init__``; each phase's peak resident memory its own, and the time to load."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor
from torch.utils.data import DataLoader

from harness.rank import run_rank
from lightning_pipe import GPipeStrategy
from ranks.memory_setup import peak_resident_bytes, reset_peak


class FineTune(LightningModule):
    """A causal LM from a Hugging Face directory: built from its config in ``configure_model`` (the strategy fills
    it), or loaded with ``from_pretrained`` in ``__init__``."""

    def __init__(self, path: str, from_pretrained: bool) -> None:
        from transformers import AutoModelForCausalLM

        super().__init__()
        self.path = path
        # In the training dtype, as fine-tuning in float32 or a mixed precision needs it.
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32) if from_pretrained else None

    def configure_model(self) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        if self.model is None:
            self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.path))

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        assert self.model is not None
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-4, momentum=0.9)


class LoadAndSteps(Callback):
    """The peak resident set and the time once set-up has loaded the weights (``on_fit_start``), then the peak of
    the training steps (the mark reset between them), and the stage share after the last step."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.answer: dict[str, Any] = {}

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.answer["load_s"] = time.perf_counter() - self.started
        self.answer["load_peak_bytes"] = peak_resident_bytes()
        reset_peak()

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.answer["steps_peak_bytes"] = peak_resident_bytes()
        parameters = [p for p in pl_module.parameters() if not p.is_meta]
        tensors = [*parameters, *(p.grad for p in parameters if p.grad is not None)]
        for optimizer in trainer.optimizers:
            tensors += [t for state in optimizer.state.values() for t in state.values() if isinstance(t, Tensor)]
        self.answer["share_bytes"] = sum(t.numel() * t.element_size() for t in tensors)


def measure(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The tiny run (its peak: the fixed footprint of a process), then ``from_pretrained`` in ``__init__``, then the
    weights read per stage, last, so that whatever the earlier runs left behind counts against it."""
    return {
        "tiny": _run(spec, spec["tiny_path"], from_pretrained=False, reset=False),
        "from_pretrained": _run(spec, spec["path"], from_pretrained=True, reset=True),
        "per_stage": _run(spec, spec["path"], from_pretrained=False, reset=True),
    }


def _run(spec: dict[str, Any], path: str, from_pretrained: bool, reset: bool) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, spec["vocab"], (spec["batch"] * spec["steps"], spec["sequence"]), generator=generator)
    strategy = GPipeStrategy(num_micro_batches=spec["batch"], log_bubble_fraction=False,
                             pretrained=None if from_pretrained else path)
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=dist.get_world_size(), max_steps=spec["steps"],
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0)
    if reset:
        reset_peak()
    started = time.perf_counter()
    recorder = LoadAndSteps(started)
    trainer.callbacks.append(recorder)
    model = FineTune(path, from_pretrained)  # from_pretrained reads the whole model here, on every rank
    trainer.fit(model, DataLoader(tokens, batch_size=spec["batch"]))
    return {"stage": strategy.stage_index, **recorder.answer}


if __name__ == "__main__":
    run_rank(measure)
