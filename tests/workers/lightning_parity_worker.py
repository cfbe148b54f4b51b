"""Worker: the Lightning-parity scenarios under the gpipe strategy; each rank saves what it saw.

Usage: python lightning_parity_worker.py SPEC.json
SPEC: {"devices": N, "out": DIR, "runs": [{"name":..., "scheduler":..., "strategy": {...}}]}
"""

import json
import sys
from pathlib import Path

import torch

import lightning_pipe
from helpers.scenarios import fit_test_predict
from helpers.process_exit import skip_the_last_collection

skip_the_last_collection()  # in every process that runs this script, ranks included


def main(spec_path):
    spec = json.loads(Path(spec_path).read_text())
    for run in spec["runs"]:
        out = Path(spec["out"]) / run["name"]
        strategy = lightning_pipe.GPipeStrategy(num_micro_batches=run.get("num_micro_batches", 4),
                                                **run.get("strategy", {}))
        result = fit_test_predict(
            out, run.get("scheduler"), run.get("early_stopping", True), strategy=strategy, devices=spec["devices"]
        )
        torch.save(result, out / f"rank{result['global_rank']}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
