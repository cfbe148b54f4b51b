"""Worker: train, or resume from a checkpoint, under the gpipe strategy; each rank saves its final weights.

Usage: python checkpoints_worker.py SPEC.json   (SPEC: {"devices": N, "out": DIR, "epochs": E, "ckpt_path": PATH or null,
"save_after_fit": true to call trainer.save_checkpoint(DIR/after_fit.ckpt) after fit, "strategy": {...}})
"""

import json
import sys
from pathlib import Path

import torch

import lightning_pipe
from helpers.scenarios import fit_epochs
from helpers.process_exit import skip_the_last_collection

skip_the_last_collection()  # in every process that runs this script, ranks included


def main(spec_path):
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out"])
    strategy = lightning_pipe.GPipeStrategy(num_micro_batches=3, **spec.get("strategy", {}))
    result = fit_epochs(out, spec["epochs"], spec.get("ckpt_path"), spec.get("save_after_fit", False),
                        strategy=strategy, devices=spec["devices"])
    torch.save(result, out / f"rank{result['global_rank']}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
