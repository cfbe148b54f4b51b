"""Worker: causal LMs fine-tuned from pretrained weights with the gpipe strategy, several runs in one launch.

Usage: python pretrained_worker.py SPEC.json   (SPEC: {"devices": N, "out": DIR, "steps": S, "runs": [...]})
A run is ``{"name", "path", "config", "module", "module_options", "key_mapping", "strategy": {GPipeStrategy
options}, "precision", "validate_only", "validate_after_fit", "save_pretrained", "max_shard_size", "save_checkpoint",
"fails"}``: the LightningModule ``module`` of :mod:`helpers.stock_models` (by default ``PretrainedCausalLM``, with
``module_options``) built in ``configure_model`` from the config in ``config`` (by default ``path``), ``GPipeStrategy(pretrained=PretrainedWeights(path,
key_mapping=key_mapping), ...)``, then ``trainer.fit`` for S
steps (or only ``trainer.validate``). Each rank writes DIR/NAME/rank{R}.pt: the tensors it holds when the run starts
(``initial``) and ends (``final``), the stored names it read through ``safetensors.safe_open(...).get_tensor``
(``read``), the training steps run, and with ``validate_after_fit`` what it holds after a validate that follows.
``export_in_run`` writes DIR/NAME/exported_in_run and in_run.ckpt as training ends (the stages still built, and
sharded with ``data_parallel``). ``save_pretrained`` writes DIR/NAME/exported (and ``exported_bf16``, cast; with ``max_shard_size``, also
``exported_shards`` cut at it); the rank's replica and the files it wrote with the tensors in each (``wrote``, counted
at the export's own ``save_file``) go into its result. ``save_checkpoint`` writes DIR/NAME/sharded.ckpt.
A run with ``fails`` (the last of its launch) must raise; each rank saves the message instead.
"""

import json
import sys
from pathlib import Path

import safetensors
import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from torch.distributed.tensor import DTensor

import lightning_pipe
from helpers import stock_models
from lightning_pipe.checkpoints import export, stored_weights
from helpers.process_exit import skip_the_last_collection

skip_the_last_collection()  # in every process that runs this script, ranks included


class CountedSafeOpen:
    """safetensors' own ``safe_open``; every ``get_tensor`` call of the files it opens is recorded in ``reads``."""

    def __init__(self, reads: list[str]) -> None:
        self.reads = reads

    def __call__(self, *args, **kwargs):
        return _CountedFile(safetensors.safe_open(*args, **kwargs), self.reads)


class _CountedFile:
    def __init__(self, opened, reads: list[str]) -> None:
        self._opened, self._reads = opened, reads

    def __enter__(self):
        self._opened.__enter__()
        return self

    def __exit__(self, *exception):
        return self._opened.__exit__(*exception)

    def get_tensor(self, name: str):
        self._reads.append(name)
        return self._opened.get_tensor(name)

    def __getattr__(self, name: str):
        return getattr(self._opened, name)


SAVE_FILE = export.save_file


class CountedSaveFile:
    """safetensors' own ``save_file``; every file written is recorded in ``wrote`` (its name -> its tensors' names)."""

    def __init__(self, wrote: dict[str, list[str]]) -> None:
        self.wrote = wrote

    def __call__(self, tensors, filename, metadata=None):
        path = Path(filename)
        self.wrote[f"{path.parent.name}/{path.name.removesuffix('.partial')}"] = sorted(tensors)
        return SAVE_FILE(tensors, filename, metadata=metadata)


def held(module) -> dict[str, torch.Tensor]:
    """The tensors this rank holds (not the other stages' layers, left on the meta device); a tensor sharded over the
    stage's replicas (a DTensor) whole, gathered from its shards (a collective over the replicas)."""
    return {key: (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
            for key, value in module.state_dict().items() if not value.is_meta}


class Held(Callback):
    """What the rank holds when the run starts, and how many training steps ran."""

    def __init__(self) -> None:
        self.initial: dict[str, torch.Tensor] = {}
        self.steps = 0

    def on_fit_start(self, trainer, pl_module):
        self.initial = held(pl_module)

    def on_validation_start(self, trainer, pl_module):
        self.initial = self.initial or held(pl_module)

    def on_train_batch_end(self, *args):
        self.steps += 1


class ExportedInRun(Callback):
    """At the end of training, while the stages still run (sharded, when they are): ``save_pretrained`` into
    ``out/exported_in_run`` and ``trainer.save_checkpoint`` into ``out/in_run.ckpt``."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module):
        trainer.strategy.save_pretrained(self.out / "exported_in_run")
        trainer.save_checkpoint(self.out / "in_run.ckpt")


def main(spec_path):
    spec = json.loads(Path(spec_path).read_text())
    for run in spec["runs"]:
        out = Path(spec["out"]) / run["name"]
        out.mkdir(parents=True, exist_ok=True)
        reads: list[str] = []
        stored_weights.safe_open = CountedSafeOpen(reads)
        wrote: dict[str, list[str]] = {}
        export.save_file = CountedSaveFile(wrote)
        recorder = Held()
        weights = lightning_pipe.PretrainedWeights(run["path"], key_mapping=run.get("key_mapping"))
        strategy = lightning_pipe.GPipeStrategy(pretrained=weights, **run.get("strategy", {}))
        trainer = Trainer(
            strategy=strategy, accelerator="cpu", devices=spec["devices"], max_steps=spec["steps"], logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, limit_val_batches=0 if not run.get("validate_only") else 1,
            precision=run.get("precision", "32-true"),
            callbacks=[recorder] + ([ExportedInRun(out)] if run.get("export_in_run") else []),
        )
        seed_everything(0, verbose=False)
        module = getattr(stock_models, run.get("module", "PretrainedCausalLM"))
        model = module(run.get("config", run["path"]), **run.get("module_options", {}))
        try:
            if run.get("validate_only"):
                trainer.validate(model, verbose=False)
            else:
                trainer.fit(model)
        except (ValueError, RuntimeError) as error:
            if not run.get("fails"):
                raise
            torch.save({"error": f"{type(error).__name__}: {error}", "steps": recorder.steps},
                       out / f"rank{strategy.global_rank}.pt")
            continue
        result = {"initial": recorder.initial, "final": held(model), "read": reads, "steps": recorder.steps}
        if run.get("validate_after_fit"):  # a second set-up of the same model object: its trained weights stay
            trainer.limit_val_batches = 1
            trainer.validate(model, verbose=False)
            result["after_validate"] = held(model)
        if run.get("save_pretrained"):
            trainer.strategy.save_pretrained(out / "exported")
            trainer.strategy.save_pretrained(out / "exported_bf16", dtype="bfloat16")
            if run.get("max_shard_size"):
                trainer.strategy.save_pretrained(out / "exported_shards", max_shard_size=run["max_shard_size"])
            result.update(replica=trainer.strategy.groups.replica, wrote=wrote)
        if run.get("save_checkpoint"):  # sharded: each rank writes its stage
            trainer.save_checkpoint(out / "sharded.ckpt")
        torch.save(result, out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
