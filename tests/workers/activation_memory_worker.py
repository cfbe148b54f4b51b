"""Worker: the peak of activations each stage holds for backward in a training step, per schedule.

Usage: python activation_memory_worker.py SPEC.json   (SPEC: {"devices": N, "out": DIR, "runs": [{"name", "schedule"}]})
Each run writes DIR/NAME/rank{R}.json: the rank's stage and the peak bytes of the tensors its training steps saved
for backward that were alive at once (parameters left out), the largest over the run's steps.
"""

import json
import sys
import weakref
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_pipe
from helpers.process_exit import skip_the_last_collection

skip_the_last_collection()  # in every process that runs this script, ranks included

WIDTH, BLOCKS, BATCH, MICRO_BATCHES = 64, 8, 64, 8


class Stack(LightningModule):
    """Equal blocks of Linear + ReLU: every micro-batch leaves each stage the same activations to keep. The loss (a
    mean) saves nothing of its own, so that the last stage keeps only its blocks' activations too."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(BLOCKS)))

    def training_step(self, batch, batch_idx):
        x, _ = batch
        return self.blocks(x).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class PeakSavedActivations(Callback):
    """The peak bytes of tensors saved for backward and still alive, counted by storage, during training steps."""

    def __init__(self) -> None:
        self.peak = 0
        self._alive: dict[int, tuple[weakref.ref, int]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._parameters: set[int] = set()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._parameters = {p.untyped_storage().data_ptr() for p in pl_module.parameters() if not p.is_meta}
        self._hooks.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._hooks.__exit__(None, None, None)
        self._alive.clear()

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self._parameters and storage.nbytes():
            self._alive[storage.data_ptr()] = (weakref.ref(tensor), storage.nbytes())
            self._alive = {ptr: entry for ptr, entry in self._alive.items() if entry[0]() is not None}
            self.peak = max(self.peak, sum(size for _, size in self._alive.values()))
        return tensor


def main(spec_path):
    spec = json.loads(Path(spec_path).read_text())
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4 * BATCH, WIDTH, generator=generator), torch.randn(4 * BATCH, WIDTH, generator=generator))
    for run in spec["runs"]:
        seed_everything(0, verbose=False)
        peak = PeakSavedActivations()
        strategy = lightning_pipe.GPipeStrategy(
            num_micro_batches=MICRO_BATCHES, checkpoint="never", schedule=run["schedule"], log_bubble_fraction=False
        )
        trainer = Trainer(
            strategy=strategy, accelerator="cpu", devices=spec["devices"], max_epochs=1, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[peak],
        )
        trainer.fit(Stack(), DataLoader(data, batch_size=BATCH))
        out = Path(spec["out"]) / run["name"]
        out.mkdir(parents=True, exist_ok=True)
        result = {"stage": trainer.strategy.stage_index, "peak_bytes": peak.peak}
        (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
