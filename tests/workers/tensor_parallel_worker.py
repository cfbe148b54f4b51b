"""Worker: `Trainer.fit` runs with blocks split by tensor parallelism inside each stage, several in one launch.

Usage: python tensor_parallel_worker.py SPEC.json
(SPEC: {"devices": N, "out": DIR, "runs": [{"name": ..., "model": ..., "strategy": {...}, "trainer": {...}}, ...]})
Each run writes DIR/NAME/rank{R}.pt (the model's whole state dict after fit) and DIR/NAME/rank{R}.json (per-step
losses, the clipping norms as hex, and what the rank held during training: its parameters', gradients' and optimizer
state's bytes in the blocks, and which parameters stayed whole; with ``validate_after``, trainer.validate's val_loss
after the fit). A run with ``expect_error`` writes
DIR/NAME/error{R}.txt instead and ends the launch's runs; one with ``uncounted_slices`` is a negative control.
"""

import json
import sys
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.distributed.tensor import DTensor

import lightning_pipe
from helpers.negative_controls import count_every_slice_on_every_rank, record_clipping_norms
from helpers.process_exit import skip_the_last_collection
from helpers.recording import MetricRecorder
from helpers.tensor_parallel_models import TENSOR_PARALLEL_MODELS, loaders_for

skip_the_last_collection()


def local_bytes(tensor):
    tensor = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return tensor.numel() * tensor.element_size()


class HeldState(Callback):
    """After the first training step (its optimizer step done, its gradients still held): the bytes of this rank's block parameters, their gradients and their optimizer
    state (a split parameter's slice only), and the names of the block parameters that every rank holds whole."""

    def __init__(self, container: str) -> None:
        self.container, self.held = container, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.held is not None:
            return
        optimizer = trainer.optimizers[0]
        blocks = pl_module.get_submodule(self.container)
        named = [(n, p) for n, p in blocks.named_parameters() if not p.is_meta]
        state = [t for p in (p for _, p in named) for t in optimizer.state.get(p, {}).values()
                 if isinstance(t, torch.Tensor) and t.dim() > 0]
        self.held = {
            "parameters": sum(local_bytes(p) for _, p in named),
            "gradients": sum(local_bytes(p.grad) for _, p in named if p.grad is not None),
            "optimizer": sum(local_bytes(t) for t in state),
            "whole": sorted(n for n, p in named
                            if not isinstance(p, DTensor) or all(x.is_replicate() for x in p.placements)),
        }


def main(spec_path):
    spec = json.loads(Path(spec_path).read_text())
    for run in spec["runs"]:
        out = Path(spec["out"]) / run["name"]
        out.mkdir(parents=True, exist_ok=True)
        restore = count_every_slice_on_every_rank() if run.get("uncounted_slices") else None
        norms = []
        undo_norms = record_clipping_norms(norms)
        recorder = MetricRecorder()

        def trainer_for(strategy, max_epochs, callbacks, checkpoints=False):
            return Trainer(
                strategy=lightning_pipe.GPipeStrategy(**strategy),
                accelerator="cpu", devices=spec["devices"], max_epochs=max_epochs, logger=False,
                enable_checkpointing=checkpoints, enable_progress_bar=False, enable_model_summary=False,
                default_root_dir=str(out), callbacks=callbacks, limit_val_batches=2, **run.get("trainer", {}),
            )

        checkpoint = None
        if run.get("first_strategy"):  # an epoch under these settings, checkpointed; the run resumes from it
            seed_everything(0)
            first = TENSOR_PARALLEL_MODELS[run["model"]]()
            trainer_for(run["first_strategy"], 1, [], checkpoints=True).fit(first, *(loaders_for(first) or ()))
            checkpoint = next((out / "checkpoints").glob("*.ckpt"))
        seed_everything(0 if checkpoint is None else 1)  # a resumed run must take its weights from the file
        model = TENSOR_PARALLEL_MODELS[run["model"]]()
        held = HeldState("blocks" if hasattr(model, "blocks") else "model.model.layers")
        trainer = trainer_for(run["strategy"], 1 if checkpoint is None else 2, [recorder, held])
        try:
            trainer.fit(model, *(loaders_for(model) or ()), ckpt_path=checkpoint)
            if run.get("save_pretrained"):
                trainer.strategy.save_pretrained(out / "pretrained")
        except Exception as error:
            if not run.get("expect_error"):
                raise
            (out / f"error{trainer.global_rank}.txt").write_text(f"{type(error).__name__}: {error}")
            return
        finally:
            undo_norms()
            if restore is not None:
                restore()
        rank = trainer.global_rank
        state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
        torch.save(state, out / f"rank{rank}.pt")
        summary = recorder.summary()
        summary["clipping_norms"] = norms
        summary["held"] = held.held
        if run.get("validate_after"):  # a later run on the same module: configure_model builds and splits nothing
            summary["validated"] = trainer.validate(model, loaders_for(model)[1], verbose=False)[0]["val_loss"]
        (out / f"rank{rank}.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main(sys.argv[1])
