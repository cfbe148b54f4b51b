"""Worker: a short fit under the gpipe strategy in which one stage fails, is killed or stalls at a chosen step.

Usage: python reliability_faults_worker.py SPEC.json   (directly, or under ``python -m torch.distributed.run``)
SPEC: {"devices": N, "out": DIR, "strategy": "gpipe" | "gpipe_spawn" | "gpipe_fork", "timeout_s": null | seconds,
       "runs": [{"name": NAME, <any of the keys below>}, ...] (optional: several fits in turn, each into DIR/NAME),
       "hidden_by_rank": {"R": width, ...} (optional: rank R builds its layers that wide; the others 16),
       "num_stages": S (optional, default N: with fewer stages than devices, the pipeline has replicas),
       "watchdog": {"stall_floor": s, "stall_multiple": k} | false (optional: GPipeStrategy's stall settings, or off),
       "epochs": E (optional, default 1), "checkpoint_every": n (optional: a checkpoint every n training steps),
       "batch_size_by_rank": {"R": size, ...} (optional: rank R's training loader batches that many samples; else 16),
       "train_batches_by_rank": {"R": n, ...} (optional: rank R's training set holds n batches; else 6),
       "iterable": true (optional: the training set is an iterable one, without a length),
       "sharded_checkpoints": true (optional: GPipeStrategy(save_distributed_checkpoint=True)),
       "faults": [{"kind": KIND, "where": WHERE, "stage": S, "phase": "train" | "val", "batch": B,
                   "epoch": e (optional: only in that epoch)}, ...]}
WHERE: "step", "layer", "hook" (at the start of a batch), "hook_end" (at its end), "loader" (the training data loader
reading batch B on stage S's rank) or "checkpoint" (a callback's on_save_checkpoint on stage S's rank).
KIND: "raise", "sigkill", "sigterm" or "stall" (anywhere); "sigterm_launcher" or "sigint_launcher" (the rank sends
the signal to its parent, the launching process, as a scheduler or Ctrl-C would, then is stuck); "sigusr1_all" (the
rank sends SIGUSR1 to every rank, as SLURM does before a job's time limit, then goes on); "slow" (sleeps twice the bound the stall watchdog would set
now, then goes on); "busy" (sleeps the fault's "seconds", then goes on: a rank busy in its own work; with "once",
only the first time it is due in the process, as a data set that opens its files on its first read, writing
OUT/busy-WHERE-R.json: the seconds, and the first step's bound in force once training started); or a misuse by a pipelined layer (``where="layer"``): its output is
"non_tensor" (a dict), "non_tensor_everywhere" (a dict on every rank, as a user's block returns it: the
placeholders other ranks compute on the meta device too), "batch_dim" (the first row only), "dtype" (float64 where the next stage has float32) or
"nan" (NaN: the loss becomes NaN); or "skip" (``where="step"``, stage 0): the first stage's step returns before the
pipelined call while the last stage's calls it.

``where="step"`` fires in the user's step: before the pipelined call on the first stage, after it (where only the
last stage runs) otherwise. ``where="layer"`` fires inside a pipelined layer held by stage ``S`` (any stage,
middle ones included); ``where="hook"`` in a callback at the start of the batch, on stage ``S``.

Each rank writes DIR/rank{R}.json when it ends (``"finished"`` with its logged losses, and DIR/rank{R}.pt with its
weights; or the exception that ended it); the spawn and fork launchers' process writes DIR/launcher.json. A faulty
rank writes DIR/fault{R}.json (the fault and the wall-clock time) right before its fault.
"""

import json
import os
import signal
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

import lightning_pipe
from helpers.models import classification_data
from helpers.process_exit import skip_the_last_collection

skip_the_last_collection()  # in every process that runs this script, ranks included

FAULT_MESSAGE = "injected fault"
MISUSES = ("non_tensor", "non_tensor_everywhere", "batch_dim", "dtype", "nan", "skip")
_where_we_are = {"phase": None, "batch": -1, "epoch": 0}  # set by Position on every rank before each step


class InjectedFault(RuntimeError):
    """The user error of these runs: its name and message must reach the user's terminal."""


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _stage(trainer: Trainer) -> int:
    return getattr(trainer.strategy, "stage_index", 0)  # one device: a single stage


class Position(Callback):
    """Tracks the phase and batch on every rank; fires ``where="hook"`` faults at the start of a batch."""

    def __init__(self, faults: "Faults") -> None:
        self.faults = faults

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        _where_we_are.update(phase="train", batch=batch_idx, epoch=trainer.current_epoch)
        self.faults.fire_if_due("hook", _stage(trainer))

    def on_train_start(self, trainer, pl_module):
        self.faults.strategy = trainer.strategy
        if self.faults.out is not None:  # for faults that signal every rank
            (self.faults.out / f"pid{trainer.global_rank}").write_text(str(os.getpid()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.faults.fire_if_due("hook_end", _stage(trainer))

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        _where_we_are.update(phase="val", batch=batch_idx)
        self.faults.fire_if_due("hook", _stage(trainer))

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.faults.fire_if_due("checkpoint", _stage(trainer))


class LoadingFaults(torch.utils.data.Dataset):
    """A training set whose reading of batch ``B`` fires the ``where="loader"`` faults on the stage's rank (the data
    loader reads a batch ahead: batch B is read as step B - 1 starts)."""

    def __init__(self, data: torch.utils.data.Dataset, batch_size: int, faults: "Faults") -> None:
        self.data, self.batch_size, self.faults = data, batch_size, faults
        self.trainer: Trainer | None = None

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int):
        if index % self.batch_size == 0 and self.trainer is not None:
            self.faults.fire_if_loading(index // self.batch_size, _stage(self.trainer))
        return self.data[index]


class Streamed(torch.utils.data.IterableDataset):
    """A dataset read as a stream, without a length (as a web dataset or a generator is)."""

    def __init__(self, data: torch.utils.data.Dataset) -> None:
        self.data = data

    def __iter__(self):
        return (self.data[index] for index in range(len(self.data)))


class LossRecorder(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


class Faults:
    def __init__(self, specs: list[dict], out: Path | None) -> None:
        self.specs, self.out = specs, out
        self._fired_once: set[int] = set()  # the faults with "once" that fired in this process (by index)
        self.strategy: Any = None  # set at the start of training: its stall watchdog's clock sets the "slow" sleeps

    def stages(self, where: str) -> set[int]:
        return {spec["stage"] for spec in self.specs if spec["where"] == where}

    def due(self, where: str, stage: int) -> list[dict]:
        position = (where, stage, _where_we_are["phase"], _where_we_are["batch"])
        return [
            spec for spec in self.specs if (spec["where"], spec["stage"], spec["phase"], spec["batch"]) == position
            and spec.get("epoch", _where_we_are["epoch"]) == _where_we_are["epoch"]
            and spec.get("rank", _rank()) == _rank()  # "rank": one replica of the stage only
        ]

    def fire_if_loading(self, batch: int, stage: int) -> None:
        for spec in self.specs:
            if (spec["where"], spec["stage"], spec["batch"]) == ("loader", stage, batch):
                self._fire(spec)

    def fire_if_due(self, where: str, stage: int) -> None:
        for spec in self.due(where, stage):
            if spec["kind"] not in MISUSES:
                self._fire(spec)

    def misuse_due(self, where: str, stage: int, kind: str | None = None) -> str | None:
        """The misuse due here (only ``kind``, if given), recorded as fired."""
        for spec in self.due(where, stage):
            if spec["kind"] in MISUSES and spec["kind"] == (kind or spec["kind"]):
                self._record(spec)
                return spec["kind"]
        return None

    def _record(self, spec: dict) -> None:
        if self.out is not None:
            (self.out / f"fault{_rank()}.json").write_text(json.dumps({"time": time.time(), **spec}))

    def would_be_bound(self) -> float:
        """The bound a wait would have now if it were bounded (from the stall watchdog's step times)."""
        clock = self.strategy._watchdog.clock
        return clock.rule.bound_s(clock.slowest_s)

    def _fire(self, spec: dict) -> None:
        if spec["kind"] == "slow":  # legitimately slow: longer than the bound would be, then on (OUT/slow-*.json)
            seconds = 2 * self.would_be_bound()
            if self.out is not None:
                name = f"slow-{spec['where']}-{spec['phase']}-{_rank()}.json"
                (self.out / name).write_text(json.dumps({"seconds": seconds, "bound": self.would_be_bound(), **spec}))
            time.sleep(seconds)
            return
        if spec["kind"] == "busy":
            if spec.get("once"):
                if self.specs.index(spec) in self._fired_once:
                    return
                self._fired_once.add(self.specs.index(spec))
            time.sleep(spec["seconds"])
            if self.out is not None and spec.get("once"):
                clock = self.strategy._watchdog.clock if self.strategy is not None else None
                bound = clock.first_step_bound_s if clock is not None else None
                name = f"busy-{spec['where']}-{_rank()}.json"
                (self.out / name).write_text(json.dumps({"seconds": spec["seconds"], "first_step_bound": bound}))
            return
        self._record(spec)
        if spec["kind"] == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if spec["kind"] == "sigterm":  # as a cluster's scheduler or a user's `kill` would: the run must stop
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if spec["kind"] == "sigusr1_all":
            assert self.out is not None
            for pid in self.out.glob("pid*"):
                os.kill(int(pid.read_text()), signal.SIGUSR1)
            return
        if spec["kind"] in ("sigterm_launcher", "sigint_launcher"):  # the launching process is told to stop while
            stop = signal.SIGTERM if spec["kind"] == "sigterm_launcher" else signal.SIGINT  # this rank is stuck
            os.kill(os.getppid(), stop)
            time.sleep(600)
        if spec["kind"] == "stall":
            time.sleep(600)  # far beyond any timeout: the launcher or the peers' timeout must end this process
        raise InjectedFault(
            f"{FAULT_MESSAGE} in {spec['where']} on stage {spec['stage']} at {spec['phase']} batch {spec['batch']}"
        )


class Tripwire(nn.Module):
    """A pipelined layer that fires the fault, or returns the misused output, on the stage holding it."""

    def __init__(self, layer: nn.Module, stage: int, faults: Faults) -> None:
        super().__init__()
        self.layer, self.stage, self.faults = layer, stage, faults

    def forward(self, x):
        if self.faults.misuse_due("layer", self.stage, "non_tensor_everywhere"):  # as a user's block would: on
            return {"features": self.layer(x)}  # every rank, its placeholders on the meta device included
        if x.is_meta:  # another stage's placeholder of this layer's output (shapes only): not where it runs
            return self.layer(x)
        self.faults.fire_if_due("layer", self.stage)
        y = self.layer(x)
        misuse = self.faults.misuse_due("layer", self.stage)
        if misuse == "non_tensor":
            return {"features": y}
        if misuse == "batch_dim":
            return y[:1]
        if misuse == "dtype":
            return y.double()
        if misuse == "nan":
            return y * float("nan")
        return y


class FaultyModel(LightningModule):
    """Two layers per stage; the last layer of a stage with a layer fault is a tripwire."""

    def __init__(self, num_stages: int, faults: Faults, hidden: int = 16) -> None:
        super().__init__()
        self.faults = faults
        layers: list[nn.Module] = []
        for stage in range(num_stages):
            linear = nn.Linear(12 if stage == 0 else hidden, hidden)
            last: nn.Module = nn.Tanh()  # its output is what the stage sends on
            layers += [linear, Tripwire(last, stage, faults) if stage in faults.stages("layer") else last]
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(hidden, 3)

    def _step(self, batch):
        x, y = batch
        stage = _stage(self.trainer)
        if stage == 0:
            self.faults.fire_if_due("step", 0)
            if self.faults.misuse_due("step", 0) == "skip":
                return None  # a step that takes another path on the first stage than on the last
        loss = F.cross_entropy(self.head(self.layers(x.view(len(x), -1))), y)
        if stage > 0:  # only the last stage gets here
            self.faults.fire_if_due("step", stage)
        return loss

    def training_step(self, batch, batch_idx):
        loss = self._step(batch)
        if loss is not None:
            self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self._step(batch))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(
    devices: int, faults: Faults, strategy: Any = "auto", hidden: int = 16, stages: int | None = None,
    epochs: int = 1, checkpoint_every: int | None = None, batch_size: int = 16, train_batches: int = 6,
    iterable: bool = False,
) -> tuple[FaultyModel, Trainer, list]:
    """``epochs`` epochs of ``train_batches`` training batches of ``batch_size`` (from an iterable training set, if
    ``iterable``: Lightning then learns the epoch's end only as it comes) and 6 validation batches of 16 on ``stages``
    stages (default: ``devices``), with a checkpoint every ``checkpoint_every`` training steps."""
    seed_everything(0)
    model = FaultyModel(stages or devices, faults, hidden)
    recorder = LossRecorder()
    callbacks: list[Callback] = [Position(faults), recorder]
    if checkpoint_every is not None:
        callbacks.append(ModelCheckpoint(dirpath="ckpt", every_n_train_steps=checkpoint_every, save_top_k=-1))
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=devices if strategy != "auto" else 1, max_epochs=epochs,
        limit_train_batches=None if iterable else train_batches, limit_val_batches=6, num_sanity_val_steps=0, logger=False,
        enable_checkpointing=checkpoint_every is not None, enable_progress_bar=False, enable_model_summary=False,
        callbacks=callbacks,
    )
    train_set = LoadingFaults(classification_data(batch_size * train_batches), batch_size, faults)
    train_set.trainer = trainer
    train_loader = DataLoader(Streamed(train_set) if iterable else train_set, batch_size=batch_size)
    trainer.fit(model, train_loader, DataLoader(classification_data(96), batch_size=16))
    return model, trainer, recorder.losses


def run(spec: dict, out: Path) -> None:
    """One fit as ``spec`` says; this process's end (finished, or the exception) goes to OUT/{rankR|launcher}.json."""
    spawned = spec.get("strategy", "gpipe") in ("gpipe_spawn", "gpipe_fork")  # the ranks are children; this launches
    rank = "launcher" if spawned else os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))
    trainer = None
    try:
        timeout = timedelta(seconds=spec["timeout_s"]) if spec.get("timeout_s") else None
        kwargs = {"timeout": timeout} if timeout is not None else {}
        start_method = {"gpipe": "popen", "gpipe_spawn": "spawn", "gpipe_fork": "fork"}[spec.get("strategy", "gpipe")]
        stages = spec.get("num_stages")  # fewer than devices: data-parallel replicas of the pipeline
        watchdog = spec.get("watchdog")
        kwargs |= {"stall_watchdog": False} if watchdog is False else (watchdog or {})
        if spec.get("sharded_checkpoints"):
            kwargs["save_distributed_checkpoint"] = True
        strategy = lightning_pipe.GPipeStrategy(stages, num_micro_batches=4, start_method=start_method, **kwargs)
        # A misuse: a model size that depends on the rank (LOCAL_RANK is set in the ranks the launcher starts).
        hidden = spec.get("hidden_by_rank", {}).get(os.environ.get("LOCAL_RANK", "0"), 16)
        faults = Faults(spec.get("faults", []), out)
        # A misuse: data loaders that differ by rank (a batch size, or a number of batches).
        batch_size = spec.get("batch_size_by_rank", {}).get(os.environ.get("LOCAL_RANK", "0"), 16)
        train_batches = spec.get("train_batches_by_rank", {}).get(os.environ.get("LOCAL_RANK", "0"), 6)
        model, trainer, losses = fit(
            spec["devices"], faults, strategy, hidden, stages, spec.get("epochs", 1), spec.get("checkpoint_every"),
            batch_size, train_batches, spec.get("iterable", False),
        )
        name = "launcher" if spawned else f"rank{trainer.global_rank}"
        (out / f"{name}.json").write_text(json.dumps({"ended": "finished", "losses": losses}))
        torch.save(model.state_dict(), out / f"{name}.pt")
    except BaseException as exception:
        name = "launcher" if spawned else f"rank{trainer.global_rank if trainer is not None else rank}"
        ended = {"ended": type(exception).__name__, "message": str(exception)[:2000], "time": time.time()}
        ended["traceback"] = traceback.format_exc()[-4000:]
        (out / f"{name}.json").write_text(json.dumps(ended))
        raise


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    if "runs" not in spec:
        run(spec, out)
        return
    # Several fits in turn, each into OUT/NAME: a fit that fails alike on every rank (at setup) lets the next one run.
    failure: Exception | None = None
    for item in spec["runs"]:
        (out / item["name"]).mkdir(parents=True, exist_ok=True)
        try:
            run({**spec, **item}, out / item["name"])
        except Exception as exception:  # noqa: BLE001  (recorded by run; raised once every fit has had its turn)
            failure = exception
    if failure is not None:
        raise failure


if __name__ == "__main__":
    main(sys.argv[1])
