"""Worker: fits of models built in configure_model, under init_module, or eagerly, under the gpipe strategy.

Usage: python memory_setup_worker.py SPEC.json   (SPEC: {"devices": N, "out": DIR, "runs": [{"name": ..., ...}]})
A run is ``{"name", "model": "deferred"|"init_module"|"eager", "epochs", "ckpt_path", "balance", "fails"}``
(``fails``: the run must raise, on rank 0 a ValueError, elsewhere the RuntimeError that relays it; the message is
saved instead). Each writes
DIR/NAME/rank{R}.pt with what :func:`helpers.deferred_models.fit` returns.
"""

import json
import os
import sys
from pathlib import Path

import torch

import lightning_pipe
from helpers.deferred_models import fit


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


def main(spec_path):
    spec = json.loads(Path(spec_path).read_text())
    for run in spec["runs"]:
        out = Path(spec["out"]) / run["name"]
        ckpt_path = run.get("ckpt_path")
        if ckpt_path is not None:
            ckpt_path = str(page_sized_copy(Path(ckpt_path), out.parent / f"{run['name']}_resumed_from.ckpt"))
        kind = ResidentCheckpointBytes if ckpt_path else lightning_pipe.GPipeStrategy
        balance = {"balance": run["balance"], "sample": torch.randn(4, 3, 4)} if "balance" in run else {}
        strategy = kind(num_micro_batches=run.get("num_micro_batches", 4), **balance)
        try:
            result = fit(out, run.get("model", "deferred"), run.get("epochs", 1), ckpt_path,
                         strategy=strategy, devices=spec["devices"])
        except (ValueError, RuntimeError) as error:  # a run expected to fail (the last of its launch): keep the message
            if not run.get("fails"):
                raise
            out.mkdir(parents=True, exist_ok=True)
            torch.save({"error": str(error)}, out / f"rank{strategy.global_rank}.pt")
            continue
        torch.save(result, out / f"rank{result['global_rank']}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
