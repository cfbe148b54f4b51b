"""Worker: fits with sharded checkpoints under the gpipe strategy, one of whose saves is killed, fails for lack of
room, or that resume from a checkpoint a crash left.

Usage: python checkpoint_crashes_worker.py SPEC.json
SPEC: {"devices": N, "out": DIR, "runs": [{"name": NAME, "epochs": E, "ckpt_dir": DIR, "ckpt_path": PATH | "last" |
       null, "kill": {"at": AT, "rank": R, "save": n} (optional), "full_disk": {"rank": R, "save": n, "bytes": b}
       (optional), "in_place": true (optional)}, ...]}

Each run fits ProjectModule (SGD with momentum, an epoch-wise schedule: state beyond the weights) for E epochs of 4
steps, ``ModelCheckpoint(dirpath=ckpt_dir, save_last=True)`` saving ``epoch=E-step=S.ckpt`` and then ``last.ckpt``
at every epoch end (saves 1 and 2 in epoch 0, 3 and 4 in epoch 1), sharded (``save_distributed_checkpoint=True``).

Faults, injected here by wrapping torch's own file-system writer (the package is untouched), at the n-th save of the
run, on global rank R:

* ``kill``: the rank SIGKILLs itself at AT: ``before_shard`` (before it writes its file), ``mid_shard`` (once the
  first entry of its file is written and flushed: the file is cut short) or ``before_metadata`` (global rank 0, once
  every rank's file is written, before the ``.metadata``); it writes DIR/NAME/fault{R}.json first.
* ``full_disk``: the rank writes its file under ``RLIMIT_FSIZE`` = b bytes (what a full disk does to a write), the
  limit lifted again afterwards.
* ``in_place`` (the negative control): the save as it was before checkpoints were committed whole: every rank's
  ``torch.distributed.checkpoint`` part written into the checkpoint's own directory, no part records.

Each rank writes DIR/NAME/rank{R}.json when a run ends (``"finished"``, or the exception, with the run's start and
end times) and, when it finished, DIR/NAME/rank{R}.pt with its weights. A run that fails alike on every rank lets the
next one run.
"""

import json
import os
import resource
import signal
import sys
import time
import traceback
from pathlib import Path

import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.checkpoint import filesystem

import lightning_pipe
from helpers.models import ProjectModule
from helpers.process_exit import skip_the_last_collection
from helpers.scenarios import data
from lightning_pipe.checkpoints import sharded, strategy_io

skip_the_last_collection()  # in every process that runs this script, ranks included

_now = {"run": {}, "out": Path("."), "saves": 0}  # the run in progress, its directory, and its saves so far
_committed = strategy_io.save_committed


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _due(at: str) -> bool:
    kill = _now["run"].get("kill")
    return bool(kill) and kill["at"] == at and kill["rank"] == _rank() and kill["save"] == _now["saves"]


def _die(at: str) -> None:
    record = {"time": time.time(), "at": at, "save": _now["saves"]}
    (_now["out"] / f"fault{_rank()}.json").write_text(json.dumps(record))
    os.kill(os.getpid(), signal.SIGKILL)


def _install_faults() -> None:
    writer = filesystem.FileSystemWriter
    set_up, write_data, finish, write_item = (writer.set_up_storage_writer, writer.write_data, writer.finish,
                                              filesystem._write_item)

    def counted_set_up(self, *args, **kwargs):  # once per save, on every rank
        _now["saves"] += 1
        return set_up(self, *args, **kwargs)

    def faulty_write_data(self, plan, planner):
        if _due("before_shard"):
            _die("before_shard")
        full = _now["run"].get("full_disk")
        if full and full["rank"] == _rank() and full["save"] == _now["saves"]:
            soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (full["bytes"], hard))
            try:
                return write_data(self, plan, planner)
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        return write_data(self, plan, planner)

    def faulty_write_item(transforms, stream, *args, **kwargs):
        result = write_item(transforms, stream, *args, **kwargs)
        if _due("mid_shard"):
            stream.flush()
            _die("mid_shard")
        return result

    def faulty_finish(self, metadata, results):
        if _due("before_metadata"):
            _die("before_metadata")
        return finish(self, metadata, results)

    writer.set_up_storage_writer, writer.write_data, writer.finish = counted_set_up, faulty_write_data, faulty_finish
    filesystem._write_item = faulty_write_item


def _in_place(checkpoint, path, state_keys, parameter_order, groups) -> None:
    """The negative control's save: into the checkpoint's own directory, as before saves were committed whole."""
    sharded.save(checkpoint, path, state_keys, parameter_order)


def fit(run: dict, devices: int) -> dict:
    seed_everything(0 if run.get("ckpt_path") is None else 1)  # a resumed run must take its weights from the checkpoint
    model = ProjectModule(scheduler="epoch")
    strategy = lightning_pipe.GPipeStrategy(num_micro_batches=3, save_distributed_checkpoint=True)
    trainer = Trainer(strategy=strategy, accelerator="cpu", devices=devices, max_epochs=run["epochs"], logger=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[ModelCheckpoint(dirpath=run["ckpt_dir"], save_last=True)])
    trainer.fit(model, data(64, 0), data(32, 1), ckpt_path=run.get("ckpt_path"))
    return {"state_dict": {k: v.clone() for k, v in model.state_dict().items()}, "global_rank": trainer.global_rank}


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    _install_faults()
    failure = None
    for run in spec["runs"]:
        out = Path(spec["out"]) / run["name"]
        out.mkdir(parents=True, exist_ok=True)
        _now.update(run=run, out=out, saves=0)
        strategy_io.save_committed = _in_place if run.get("in_place") else _committed
        started = time.time()
        try:
            result = fit(run, spec["devices"])
        except Exception as exception:  # noqa: BLE001  (recorded; raised once every run has had its turn)
            ended = {"ended": type(exception).__name__, "message": str(exception)[:4000],
                     "traceback": traceback.format_exc()[-4000:]}
            failure = exception
            rank = _rank()
        else:
            ended = {"ended": "finished"}
            rank = result["global_rank"]
            torch.save(result, out / f"rank{rank}.pt")
        (out / f"rank{rank}.json").write_text(json.dumps({**ended, "started": started, "time": time.time()}))
    if failure is not None:
        raise failure


if __name__ == "__main__":
    main(sys.argv[1])
