"""Worker: the Lightning-parity scenarios under the gpipe strategy; each rank saves what it saw.

Usage: python parity_runs.py SPEC.json   (SPEC: {"devices": N, "out": DIR, "runs": [{"name":..., "scheduler":...}]})
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import lightning_pipe  # noqa: E402
from helpers.scenarios import fit_test_predict  # noqa: E402


def main(spec_path):
    spec = json.loads(Path(spec_path).read_text())
    for run in spec["runs"]:
        out = Path(spec["out"]) / run["name"]
        strategy = lightning_pipe.GPipeStrategy(num_micro_batches=run.get("num_micro_batches", 4))
        result = fit_test_predict(
            out, run.get("scheduler"), run.get("early_stopping", True), strategy=strategy, devices=spec["devices"]
        )
        torch.save(result, out / f"rank{result['global_rank']}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
