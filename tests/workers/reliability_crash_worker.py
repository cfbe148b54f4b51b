"""Worker: train with a last checkpoint at every epoch end and have one rank killed mid-epoch; or resume that run.

Usage: python reliability_crash_worker.py SPEC.json
SPEC: {"devices": N, "out": DIR, "epochs": E, "mode": "crash" | "resume", "kill": {"epoch": e, "batch": b}}

``crash`` trains into DIR/ckpt until the rank holding the first pipelined layer (the first stage) SIGKILLs itself
inside that layer's forward at batch ``b`` of epoch ``e``, having written DIR/fault{R}.json (the wall-clock time).
``resume`` continues from DIR/ckpt's last checkpoint (``ckpt_path="last"``) to E epochs, then trains the same model
uninterrupted into DIR/uninterrupted; each rank writes both final state dicts to DIR/rank{R}.pt.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

import lightning_pipe
from helpers.models import ProjectModule
from helpers.scenarios import data
from helpers.process_exit import skip_the_last_collection

skip_the_last_collection()  # in every process that runs this script, ranks included


def kill_inside(layer: nn.Module, model: LightningModule, epoch: int, batch: int, out: Path) -> None:
    """SIGKILL the process running ``layer`` in training at batch ``batch`` of epoch ``epoch``: mid-step."""

    def hook(module, inputs):
        if inputs[0].is_meta:  # another stage's placeholder of the layer's output (shapes only): not where it runs
            return
        trainer = model.trainer
        if model.training and (trainer.current_epoch, trainer.fit_loop.epoch_loop.batch_idx) == (epoch, batch):
            (out / f"fault{torch.distributed.get_rank()}.json").write_text(json.dumps({"time": time.time()}))
            os.kill(os.getpid(), signal.SIGKILL)

    layer.register_forward_pre_hook(hook)


def fit(run_dir: Path, devices: int, epochs: int, ckpt_path: str | None = None, kill: dict | None = None) -> dict:
    """ProjectModule (SGD with momentum and an epoch-wise learning-rate schedule: state beyond the weights)."""
    seed_everything(0 if ckpt_path is None else 1)  # a resumed run must take its weights from the checkpoint
    model = ProjectModule(scheduler="epoch")
    if kill is not None:
        kill_inside(model.net.model[0], model, kill["epoch"], kill["batch"], run_dir)
    callbacks: list[Callback] = [ModelCheckpoint(dirpath=run_dir / "ckpt", save_last=True)]
    trainer = Trainer(
        strategy=lightning_pipe.GPipeStrategy(num_micro_batches=3), accelerator="cpu", devices=devices,
        max_epochs=epochs, logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
    )
    trainer.fit(model, data(64, 0), data(32, 1), ckpt_path=ckpt_path)
    return {"state_dict": {k: v.clone() for k, v in model.state_dict().items()}, "global_rank": trainer.global_rank}


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    out, devices, epochs = Path(spec["out"]), spec["devices"], spec["epochs"]
    if spec["mode"] == "crash":
        fit(out, devices, epochs, kill=spec["kill"])
        raise AssertionError("the run was meant to be killed before it finished")
    resumed = fit(out, devices, epochs, ckpt_path="last")
    uninterrupted = fit(out / "uninterrupted", devices, epochs)
    torch.save(
        {"resumed": resumed["state_dict"], "uninterrupted": uninterrupted["state_dict"]},
        out / f"rank{resumed['global_rank']}.pt",
    )


if __name__ == "__main__":
    main(sys.argv[1])
