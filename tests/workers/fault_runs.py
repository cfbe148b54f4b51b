"""Worker: a short fit under the gpipe strategy in which one stage fails, is killed or stalls at a chosen step.

Usage: python fault_runs.py SPEC.json   (directly, or under ``python -m torch.distributed.run``)
SPEC: {"devices": N, "out": DIR, "strategy": "gpipe" | "gpipe_spawn", "timeout_s": null | seconds,
       "faults": [{"kind": "raise" | "sigkill" | "stall", "where": "step" | "layer" | "hook", "stage": S,
                   "phase": "train" | "val", "batch": B}, ...]}

``where="step"`` fires in the user's step: before the pipelined call on the first stage, after it (where only the
last stage runs) otherwise. ``where="layer"`` fires inside a pipelined layer held by stage ``S`` (any stage,
middle ones included); ``where="hook"`` in a callback at the start of the batch, on stage ``S``. Each rank writes DIR/rank{R}.json when it ends (``"finished"``, or the exception that ended
it; the spawn launcher's process writes DIR/launcher.json); a faulty rank writes DIR/fault{R}.json (the kind and the
wall-clock time) right before its fault.
"""

import json
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import lightning_pipe  # noqa: E402
from helpers.models import classification_data  # noqa: E402

FAULT_MESSAGE = "injected fault"
_where_we_are = {"phase": None, "batch": -1}  # set by Position on every rank before each step


class InjectedFault(RuntimeError):
    """The user error of these runs: its name and message must reach the user's terminal."""


class Position(Callback):
    """Tracks the phase and batch on every rank; fires ``where="hook"`` faults at the start of a batch."""

    def __init__(self, faults: "Faults") -> None:
        self.faults = faults

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        _where_we_are.update(phase="train", batch=batch_idx)
        self.faults.fire_if_due("hook", trainer.strategy.stage_index, trainer.global_rank)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        _where_we_are.update(phase="val", batch=batch_idx)
        self.faults.fire_if_due("hook", trainer.strategy.stage_index, trainer.global_rank)


class Faults:
    def __init__(self, specs: list[dict], out: Path) -> None:
        self.specs, self.out = specs, out

    def stages(self, where: str) -> set[int]:
        return {spec["stage"] for spec in self.specs if spec["where"] == where}

    def fire_if_due(self, where: str, stage: int, rank: int) -> None:
        for spec in self.specs:
            due = (spec["where"], spec["stage"], spec["phase"], spec["batch"])
            if due == (where, stage, _where_we_are["phase"], _where_we_are["batch"]):
                self._fire(spec, rank)

    def _fire(self, spec: dict, rank: int) -> None:
        (self.out / f"fault{rank}.json").write_text(json.dumps({"time": time.time(), **spec}))
        if spec["kind"] == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if spec["kind"] == "stall":
            time.sleep(600)  # far beyond any timeout: the launcher or the peers' timeout must end this process
        raise InjectedFault(
            f"{FAULT_MESSAGE} in {spec['where']} on stage {spec['stage']} at {spec['phase']} batch {spec['batch']}"
        )


class Tripwire(nn.Module):
    """A pipelined layer that fires the fault on the stage holding it."""

    def __init__(self, layer: nn.Module, stage: int, faults: Faults) -> None:
        super().__init__()
        self.layer, self.stage, self.faults = layer, stage, faults

    def forward(self, x):
        self.faults.fire_if_due("layer", self.stage, torch.distributed.get_rank())
        return self.layer(x)


class FaultyModel(LightningModule):
    """Two layers per stage; the first layer of a stage with a layer fault is a tripwire."""

    def __init__(self, num_stages: int, faults: Faults) -> None:
        super().__init__()
        self.faults = faults
        layers: list[nn.Module] = []
        for stage in range(num_stages):
            linear = nn.Linear(12 if stage == 0 else 16, 16)
            layers += [Tripwire(linear, stage, faults) if stage in faults.stages("layer") else linear, nn.Tanh()]
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(16, 3)

    def _step(self, batch):
        x, y = batch
        stage = self.trainer.strategy.stage_index
        if stage == 0:
            self.faults.fire_if_due("step", 0, self.global_rank)
        loss = F.cross_entropy(self.head(self.layers(x.view(len(x), -1))), y)
        if stage > 0:  # only the last stage gets here
            self.faults.fire_if_due("step", stage, self.global_rank)
        return loss

    def training_step(self, batch, batch_idx):
        loss = self._step(batch)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._step(batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    spawned = spec.get("strategy", "gpipe") == "gpipe_spawn"  # the ranks are children; this is the launcher
    rank = "launcher" if spawned else os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))
    trainer = None
    try:
        seed_everything(0)
        faults = Faults(spec["faults"], out)
        model = FaultyModel(spec["devices"], faults)
        timeout = timedelta(seconds=spec["timeout_s"]) if spec.get("timeout_s") else None
        kwargs = {"timeout": timeout} if timeout is not None else {}
        start_method = {"gpipe": "popen", "gpipe_spawn": "spawn"}[spec.get("strategy", "gpipe")]
        strategy = lightning_pipe.GPipeStrategy(num_micro_batches=4, start_method=start_method, **kwargs)
        trainer = Trainer(
            strategy=strategy, accelerator="cpu", devices=spec["devices"], max_epochs=1, limit_train_batches=6,
            limit_val_batches=6, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, callbacks=[Position(faults)],
        )
        data = DataLoader(classification_data(96), batch_size=16)
        trainer.fit(model, data, data)
        name = "launcher" if spawned else f"rank{trainer.global_rank}"
        (out / f"{name}.json").write_text(json.dumps({"ended": "finished"}))
    except BaseException as exception:
        name = "launcher" if spawned else f"rank{trainer.global_rank if trainer is not None else rank}"
        ended = {"ended": type(exception).__name__, "message": str(exception)[:2000], "time": time.time()}
        ended["traceback"] = traceback.format_exc()[-4000:]
        (out / f"{name}.json").write_text(json.dumps(ended))
        raise


if __name__ == "__main__":
    main(sys.argv[1])
