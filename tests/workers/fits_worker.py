"""Worker: several `Trainer.fit` runs with the gpipe strategy in one launch, results written per rank.

Usage: python fits_worker.py SPEC.json   (SPEC: {"devices": N, "out": DIR, "runs": [{"name": ..., ...}, ...]})
Each run writes DIR/NAME/rank{R}.pt (the rank's state dict) and DIR/NAME/rank{R}.json (losses, metrics).
"""

import atexit
import json
import os
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.plugins import MixedPrecision

import lightning_pipe
from helpers.models import MODELS, loaders
from helpers.recording import MetricRecorder
from lightning_pipe import engine


def drop_gradient_of(micro_batch):
    """Negative control: the last stage sends zeros instead of one micro-batch's input gradient."""
    original = engine._OrderedGradientSender._ready

    def ready(self, m, grads):
        if m == micro_batch:
            grads = tuple(torch.zeros_like(g) if g is not None else None for g in grads)
        original(self, m, grads)

    engine._OrderedGradientSender._ready = ready
    return lambda: setattr(engine._OrderedGradientSender, "_ready", original)


def main(spec_path):
    spec = json.loads(Path(spec_path).read_text())
    # Registered before any run: it runs after lightning_pipe's own exit handler, and records what that left.
    exits = Path(spec["out"], "exits")
    exits.mkdir(exist_ok=True)
    atexit.register(lambda: (exits / str(os.getpid())).write_text(str(dist.is_initialized())))
    for run in spec["runs"]:
        train, val = loaders(
            run.get("train_samples", 80), run.get("val_samples", 40), run.get("batch_size", 16), run.get("shuffle", False)
        )
        restore = drop_gradient_of(run["drop_gradient_of"]) if run.get("drop_gradient_of") is not None else None
        recorder = MetricRecorder()
        if run.get("schedule") == "backwards_in_forward_order":  # a test-only schedule, defined in its test
            from test_equivalence import backwards_in_forward_order

            run.setdefault("strategy", {})["schedule"] = backwards_in_forward_order
        trainer = Trainer(
            strategy=lightning_pipe.GPipeStrategy(
                num_micro_batches=run["num_micro_batches"],
                checkpoint=run.get("checkpoint", "except_last"),
                start_method=run.get("start_method", "popen"),
                **run.get("strategy", {}),
            ),
            accelerator="cpu",
            devices=spec["devices"],
            max_epochs=run.get("max_epochs", 1),
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[recorder],
            **run.get("trainer", {}),
        plugins=[MixedPrecision("16-mixed", "cpu")] if run.get("fp16") else None,
        )
        seed_everything(0)
        with trainer.init_module(empty_init=True) if run.get("empty_init") else nullcontext():
            model = MODELS[run.get("model", "classifier")](lr=run.get("lr", 0.5))
        trainer.fit(model, train, val)
        if restore:
            restore()
        out = Path(spec["out"]) / run["name"]
        out.mkdir(parents=True, exist_ok=True)
        rank = trainer.global_rank
        torch.save(model.state_dict(), out / f"rank{rank}.pt")
        if run.get("save_after_fit"):  # in the launching process of spawn/fork: the stages' optimizers are gone
            try:
                trainer.save_checkpoint(out / "after_fit.ckpt")
            except RuntimeError as error:
                (out / "save_error.txt").write_text(str(error))
            trainer.save_checkpoint(out / "weights.ckpt", weights_only=True)
        (out / f"rank{rank}.json").write_text(json.dumps(recorder.summary()))
        if rank == 0:  # which of Lightning's cluster environments set up the ranks
            (out / "environment.txt").write_text(type(trainer.strategy.cluster_environment).__name__)


if __name__ == "__main__":
    main(sys.argv[1])
