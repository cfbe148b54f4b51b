"""One rank of the GPT-2 section: Hugging Face's ``GPT2LMHeadModel``, unchanged, trained by
``Trainer(strategy="gpipe")`` on every rank, against one process training the same model alone.

Rounds alternate: one process's reference steps (rank 0 alone, the other ranks waiting: the whole batch, then one
micro-batch), then a ``Trainer.fit`` of ``steps`` steps on all ranks. A pipelined step's time is the interval
between the ends of consecutive steps on the last stage (global rank 0), the first one of each fit dropped.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from torch import Tensor
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel

from harness.rank import run_rank
from harness.timing import StepEnds, measuring_trainer, timed_on
from lightning_pipe import GPipeStrategy

LEARNING_RATE = 1e-4


class GPT2Module(LightningModule):
    """GPT-2 as its users train it under Lightning: the loss from the model's own ``labels=``."""

    def __init__(self, config: GPT2Config) -> None:
        super().__init__()
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch: Tensor, batch_idx: int) -> Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LEARNING_RATE)


class RepeatedTokens(torch.utils.data.Dataset):
    """The same batch of tokens ``steps`` times (a data loader's cost kept out of the step)."""

    def __init__(self, batch: Tensor, steps: int) -> None:
        self.batch, self.steps = batch, steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, index: int) -> Tensor:
        return self.batch


def config_of(spec: dict[str, Any]) -> GPT2Config:
    size = spec["model"]
    return GPT2Config(
        vocab_size=size["vocab"], n_positions=size["sequence"], n_embd=size["width"], n_layer=size["layers"],
        n_head=size["heads"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    config, m, steps = config_of(spec), spec["micro_batches"], spec["steps"]
    torch.manual_seed(0)
    batch = torch.randint(0, config.vocab_size, (spec["batch"], config.n_positions))
    micro_batch = batch[: -(-len(batch) // m)]
    alone = GPT2Module(config)
    optimizer = alone.configure_optimizers()

    def one_step(tokens: Tensor, update: bool) -> None:
        alone.training_step(tokens, 0).backward()
        if update:
            optimizer.step()
        optimizer.zero_grad()

    one_process, one_micro_batch, pipeline = [], [], []
    for round_index in range(1 + spec["rounds"]):  # the first round warms up and is dropped
        whole = [timed_on(0, lambda: one_step(batch, True)) for _ in range(steps)]
        part = [timed_on(0, lambda: one_step(micro_batch, False)) for _ in range(steps)]
        fit = _pipelined_fit(config, batch, m, steps + 1)
        if round_index > 0:
            one_process.append(whole)
            one_micro_batch.append(part)
            pipeline.append(fit)
    parameters = sum(p.numel() for p in alone.parameters())
    return {"one_process_s": one_process, "micro_batch_s": one_micro_batch, "pipeline_s": pipeline,
            "parameters": parameters}


def _pipelined_fit(config: GPT2Config, batch: Tensor, m: int, steps: int) -> list[float]:
    torch.manual_seed(0)  # every rank builds the same model
    clock = StepEnds()
    trainer = measuring_trainer(GPipeStrategy(num_micro_batches=m, checkpoint="never"), steps, clock)
    dist.barrier()
    trainer.fit(GPT2Module(config), DataLoader(RepeatedTokens(batch, steps), batch_size=None))
    return clock.intervals()


if __name__ == "__main__":
    run_rank(measure)
