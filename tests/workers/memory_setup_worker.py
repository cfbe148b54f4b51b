"""Worker: fits of models built in configure_model, under init_module, or eagerly, under the gpipe strategy.

Usage: python memory_setup_worker.py SPEC.json   (SPEC: {"devices": N, "out": DIR, "runs": [{"name": ..., ...}]})
A run is ``{"name", "model": "deferred"|"init_module"|"eager", "epochs", "ckpt_path", "balance", "fails",
"strategy": {GPipeStrategy options}, "save_after_fit"}`` (``fails``: the run must raise, on rank 0 a ValueError,
elsewhere the RuntimeError that relays it; the message is saved instead), or ``{"name", "peaks": {"width",
"depth"}, "strategy"}`` (see :func:`peaks`). Each writes DIR/NAME/rank{R}.pt with what
:func:`helpers.deferred_models.fit` (or :func:`peaks`) returns.
"""

import gc
import json
import os
import sys
from pathlib import Path

import torch

import lightning_pipe
from helpers.deferred_models import DeferredClassifier, data, fit
from lightning.pytorch import Callback, Trainer, seed_everything
from torch import Tensor
from helpers.process_exit import skip_the_last_collection

skip_the_last_collection()  # in every process that runs this script, ranks included


def resident_bytes_of(path: Path) -> int:
    """Bytes of ``path`` resident in this process through memory mappings (Linux's /proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header line
            inside = len(fields) >= 6 and fields[-1] == str(path)
        elif inside and fields[0] == "Rss:":
            total += int(fields[1]) * 1024
    return total


class ResidentCheckpointBytes(lightning_pipe.GPipeStrategy):
    """Records how much of the checkpoint file this rank holds once it has loaded its weights and optimizer state."""

    resident_checkpoint_bytes: int | None = None

    def load_optimizer_state_dict(self, checkpoint):
        super().load_optimizer_state_dict(checkpoint)
        assert self.lightning_module is not None
        path = Path(self.lightning_module.trainer.ckpt_path).resolve()
        self.resident_checkpoint_bytes = resident_bytes_of(path)


def page_sized_copy(source: Path, target: Path) -> Path:
    """``source`` rewritten in page-sized writes. Linux caches a file written in one large write (as Lightning
    writes checkpoints) in folios of up to 2 MiB and maps a whole folio at the first touch, so a mapping's resident
    bytes would count up to 2 MiB per tensor read; cached in pages, they count what was read."""
    # Global rank 0 writes it before its fit starts; the other ranks read it only after setup's collectives with it.
    if int(os.environ.get("LOCAL_RANK", 0)) == 0:
        data = source.read_bytes()
        with target.open("wb") as file:
            for start in range(0, len(data), 4096):
                file.write(data[start : start + 4096])
    return target


def resident_peak_bytes() -> int:
    """The peak resident set of this process since the last :func:`reset_resident_peak` (Linux's VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_resident_peak() -> None:
    """Set the peak-RSS mark to the current RSS (``/proc/self/clear_refs``, value 5), after freeing the garbage."""
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")


class StageShare(Callback):
    """The bytes of this rank's share once training ends: its real parameters, their gradients, optimizer state."""

    share_bytes = 0

    def on_train_end(self, trainer, pl_module):
        parameters = [p for p in pl_module.parameters() if not p.is_meta]
        tensors = [*parameters, *(p.grad for p in parameters if p.grad is not None)]
        for optimizer in trainer.optimizers:
            tensors += [t for state in optimizer.state.values() for t in state.values() if isinstance(t, Tensor)]
        self.share_bytes = sum(t.numel() * t.element_size() for t in tensors)


def peaks(out: Path, run: dict, devices: int) -> dict:
    """The peak resident set of each phase (fit, test, ``trainer.save_checkpoint`` after them) of a model built in
    configure_model, each phase's peak its own (the mark reset before it); and the fixed footprint of a process:
    the peak of the same phases with a tiny model, run first (from the resident memory when it starts)."""

    def phases(width: int, depth: int, measured: bool) -> dict:
        seed_everything(0)
        share = StageShare()
        trainer = Trainer(strategy=lightning_pipe.GPipeStrategy(num_micro_batches=4, **run.get("strategy", {})),
                          accelerator="cpu", devices=devices, max_epochs=1, logger=False, enable_progress_bar=False,
                          enable_model_summary=False, enable_checkpointing=False, callbacks=[share])
        model = DeferredClassifier(width=width, depth=depth)
        peak = {}
        for phase, action in (
            ("fit", lambda: trainer.fit(model, data(64, 0))),
            ("test", lambda: trainer.test(model, data(32, 2), verbose=False)),
            ("checkpoint", lambda: trainer.save_checkpoint(out / f"{'measured' if measured else 'tiny'}.ckpt")),
        ):
            if measured:
                reset_resident_peak()
            action()
            peak[phase] = resident_peak_bytes()
        return {"peak": peak, "share_bytes": share.share_bytes, "global_rank": trainer.global_rank}

    reset_resident_peak()  # what earlier runs in this process left is part of the footprint, not their peaks
    tiny = phases(16, 2, measured=False)
    measured = phases(run["peaks"]["width"], run["peaks"]["depth"], measured=True)
    return {**measured, "fixed_bytes": max(tiny["peak"].values())}


def main(spec_path):
    spec = json.loads(Path(spec_path).read_text())
    for run in spec["runs"]:
        out = Path(spec["out"]) / run["name"]
        if "peaks" in run:
            out.mkdir(parents=True, exist_ok=True)
            result = peaks(out, run, spec["devices"])
            torch.save(result, out / f"rank{result['global_rank']}.pt")
            continue
        ckpt_path = run.get("ckpt_path")
        if ckpt_path is not None:
            ckpt_path = str(page_sized_copy(Path(ckpt_path), out.parent / f"{run['name']}_resumed_from.ckpt"))
        kind = ResidentCheckpointBytes if ckpt_path else lightning_pipe.GPipeStrategy
        balance = {"balance": run["balance"], "sample": torch.randn(4, 3, 4)} if "balance" in run else {}
        strategy = kind(num_micro_batches=run.get("num_micro_batches", 4), **balance, **run.get("strategy", {}))
        try:
            result = fit(out, run.get("model", "deferred"), run.get("epochs", 1), ckpt_path,
                         run.get("save_after_fit", False), strategy=strategy, devices=spec["devices"])
        except (ValueError, RuntimeError) as error:  # a run expected to fail (the last of its launch): keep the message
            if not run.get("fails"):
                raise
            out.mkdir(parents=True, exist_ok=True)
            torch.save({"error": str(error)}, out / f"rank{strategy.global_rank}.pt")
            continue
        torch.save(result, out / f"rank{result['global_rank']}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
