"""Worker: models built from scratch in configure_model (see :mod:`helpers.from_scratch`), fitted under the gpipe
strategy.

Usage: python from_scratch_worker.py SPEC.json   (SPEC: {"devices": N, "out": DIR, "runs": [{"name", "model",
"strategy": {GPipeStrategy options}, "init_module": true, "drop_gradient_of": M}]})
``init_module``: the strategy gets :func:`helpers.from_scratch.init_gain`; ``drop_gradient_of``: the negative control
(see :mod:`helpers.negative_controls`). Each run writes DIR/NAME/rank{R}.pt: what :func:`helpers.from_scratch.fit`
returns, and ``initialised``, the names of the modules this rank's materialisation initialised.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import lightning_pipe
import lightning_pipe.pipeline
from helpers.from_scratch import fit, init_gain
from helpers.negative_controls import drop_gradient_of
from helpers.process_exit import skip_the_last_collection

skip_the_last_collection()  # in every process that runs this script, ranks included

materialised: list[list[str]] = []
_materialize = lightning_pipe.pipeline.materialize


def recording_materialize(*args, **kwargs) -> list[str]:
    """The strategy's own materialisation, its answer kept: which modules this rank initialised."""
    names = _materialize(*args, **kwargs)
    materialised.append(names)
    return names


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    lightning_pipe.pipeline.materialize = recording_materialize
    for run in spec["runs"]:
        out = Path(spec["out"]) / run["name"]
        out.mkdir(parents=True, exist_ok=True)
        options = {"num_micro_batches": 4, **run.get("strategy", {})}
        if run.get("init_module"):
            options["init_module"] = init_gain
        restore = drop_gradient_of(run["drop_gradient_of"]) if "drop_gradient_of" in run else None
        materialised.clear()
        result = fit(run["model"], out, strategy=lightning_pipe.GPipeStrategy(**options), devices=spec["devices"])
        if restore is not None:
            restore()
        assert len(materialised) == 1, f"materialised {len(materialised)} times"
        torch.save({**result, "initialised": materialised[0]}, out / f"rank{result['global_rank']}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
