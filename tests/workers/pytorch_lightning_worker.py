"""Worker: a project written for the standalone ``pytorch_lightning`` package (``import pytorch_lightning as pl``), moved
onto the pipeline as the README says, with ``import lightning_pipe`` first (the order isort gives).

Usage: python pytorch_lightning_worker.py SPEC.json
(SPEC: {"devices": N, "out": DIR, "steps": S, "runs": [{"name": ..., "strategy": "gpipe" or {GPipeStrategy's
arguments}, "options": {the model's arguments}}, ...]})
Each run trains Lightning's README autoencoder with ``pl.Trainer`` and writes DIR/NAME/rank{R}.pt (the model's state
dict after fit) and DIR/NAME/rank{R}.json (per-step losses and the strategy's class).
"""

import json
import sys
from pathlib import Path

import lightning_pipe
import pytorch_lightning as pl
import torch

from helpers.recording import StepLossRecording
from helpers.stock_models import lit_autoencoder_class
from helpers.process_exit import skip_the_last_collection

skip_the_last_collection()  # in every process that runs this script, ranks included

LitAutoEncoder = lit_autoencoder_class(pl.LightningModule)


class StepLosses(StepLossRecording, pl.Callback):
    pass


def main(spec_path):
    spec = json.loads(Path(spec_path).read_text())
    for run in spec["runs"]:
        out = Path(spec["out"]) / run["name"]
        out.mkdir(parents=True, exist_ok=True)
        strategy = run["strategy"]
        losses = StepLosses()
        trainer = pl.Trainer(
            strategy=strategy if isinstance(strategy, str) else lightning_pipe.GPipeStrategy(**strategy),
            accelerator="cpu", devices=spec["devices"], max_steps=spec["steps"], logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[losses],
        )
        pl.seed_everything(0, verbose=False)
        model = LitAutoEncoder(**run.get("options", {}))
        trainer.fit(model)
        rank = trainer.global_rank
        torch.save(model.state_dict(), out / f"rank{rank}.pt")
        strategy_class = f"{type(trainer.strategy).__module__}.{type(trainer.strategy).__name__}"
        (out / f"rank{rank}.json").write_text(json.dumps({"losses": losses.losses, "strategy": strategy_class}))


if __name__ == "__main__":
    main(sys.argv[1])
