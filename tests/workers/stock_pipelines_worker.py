"""Worker: the stock models of tests/helpers/stock_models.py trained with the gpipe strategy, several in one launch.

Usage: python stock_pipelines_worker.py SPEC.json
(SPEC: {"devices": N, "out": DIR, "steps": S, "runs": [{"name": ..., "model": ..., "strategy": {...}}, ...]})
Each run writes DIR/NAME/rank{R}.pt (the model's state dict after fit) and DIR/NAME/rank{R}.json (per-step losses,
a run with ``drop_gradient_of``, ``unsummed_outside`` or ``stand_ins_without_gradients`` is a negative control; with
``predict``, DIR/NAME/predictions.pt after fit; with ``save``, DIR/NAME/model.ckpt; with ``validate``, DIR/NAME/validated{R}.json, ``trainer.validate``'s metrics; with
``hooks``, DIR/NAME/hooks{R}.json: the calls of value-reading hooks on every block, see :func:`value_reading_hooks`;
with ``summary`` ({"max_depth": D, "rich": bool}), DIR/NAME/summary.txt on rank 0: what Lightning's ModelSummary or
RichModelSummary callback printed, and DIR/NAME/stages.json: the strategy's pipelined region and its replicated
parameters).
"""

import json
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary
from torch import nn

import lightning_pipe
from helpers.negative_controls import (
    answer_stand_ins_without_gradients,
    drop_gradient_of,
    leave_outside_gradients_unsummed,
)
from helpers.recording import StepLossRecording
from helpers.stock_models import BLOCKS, STOCK_MODELS
from helpers.process_exit import skip_the_last_collection

skip_the_last_collection()  # in every process that runs this script, ranks included


class StepLosses(StepLossRecording, Callback):
    pass


def value_reading_hooks(model: nn.Module, containers: list[str]) -> tuple[dict[str, dict[str, int]], Callable]:
    """Hooks as a project registers them to log activation statistics: a forward pre-hook, a forward hook and a full
    backward hook on every block of ``containers`` and on the first module inside each block, and a global forward
    hook that picks the blocks out; each reads values (``.item()``, which raises on the meta device). Returns what they
    saw, by the block's or module's name and the hook's kind: how many calls, and how many samples; and what removes
    the global hook."""
    seen: dict[str, dict[str, int]] = {}

    def reading(name: str, kind: str):
        def hook(module, *tensors):
            values = [t for t in tensors for t in (t if isinstance(t, tuple) else (t,)) if isinstance(t, torch.Tensor)]
            assert all(torch.isfinite(t.float().mean()).item() for t in values)  # the values exist
            counts = seen.setdefault(name, {}).setdefault(kind, 0)
            seen[name][kind] = counts + 1
            seen[name][f"{kind}_samples"] = seen[name].get(f"{kind}_samples", 0) + values[0].shape[0]
        return hook

    blocks = {}
    for container in containers:
        for index, block in enumerate(model.get_submodule(container)):
            name = f"{container}.{index}"
            inner_name, inner = next((n, m) for n, m in block.named_children())
            blocks[block] = name
            for target, target_name in ((block, name), (inner, f"{name}.{inner_name}")):
                target.register_forward_pre_hook(reading(target_name, "pre"))
                target.register_forward_hook(reading(target_name, "forward"))
                target.register_full_backward_hook(reading(target_name, "backward"))

    def global_hook(module, args, output):
        if module in blocks:
            reading(blocks[module], "global")(module, output)

    return seen, torch.nn.modules.module.register_module_forward_hook(global_hook).remove


class HeldParameters(Callback):
    """Writes the names of the parameters this rank holds during training (after the first step) to
    DIR/held{rank}.json."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == 0:
            names = [name for name, _ in pl_module.named_parameters(remove_duplicate=False)]
            (self.directory / f"held{trainer.global_rank}.json").write_text(json.dumps(names))


class PrintedSummary(logging.Handler):
    """What Lightning's ModelSummary callback logs (RichModelSummary prints to rich's console, recorded instead)."""

    def __init__(self, rich: bool) -> None:
        super().__init__()
        self.lines: list[str] = []
        self.console = None
        if rich:
            from rich import get_console

            self.console = get_console()
            self.console.record = True
        logging.getLogger("lightning.pytorch.callbacks.model_summary").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def text(self) -> str:
        logging.getLogger("lightning.pytorch.callbacks.model_summary").removeHandler(self)
        return self.console.export_text() if self.console is not None else "\n".join(self.lines)


def main(spec_path):
    spec = json.loads(Path(spec_path).read_text())
    for run in spec["runs"]:
        out = Path(spec["out"]) / run["name"]
        out.mkdir(parents=True, exist_ok=True)
        losses = StepLosses()
        summary = run.get("summary")
        callbacks = [losses, HeldParameters(out)]
        if summary:
            printed = PrintedSummary(summary["rich"])
            callbacks.append((RichModelSummary if summary["rich"] else ModelSummary)(max_depth=summary["max_depth"]))
        trainer = Trainer(
            strategy=lightning_pipe.GPipeStrategy(**run.get("strategy", {})),
            accelerator="cpu", devices=spec["devices"], max_steps=spec["steps"], logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=bool(summary),
            num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks,
        )
        seed_everything(0, verbose=False)
        model = STOCK_MODELS[run["model"]](**run.get("options", {}))
        hooks, remove_global_hook = value_reading_hooks(model, BLOCKS[run["model"]]) if run.get("hooks") else (None, None)
        restore = drop_gradient_of(run["drop_gradient_of"]) if run.get("drop_gradient_of") is not None else None
        if run.get("unsummed_outside"):
            restore = leave_outside_gradients_unsummed()
        if run.get("stand_ins_without_gradients"):
            restore = answer_stand_ins_without_gradients()
        if run.get("expect_error"):  # a run that must fail at set-up, on every rank: the error's first line
            try:
                trainer.fit(model)
            except Exception as error:  # noqa: BLE001
                (out / "error.txt").write_text(f"{type(error).__name__}: {error}")
                continue
            raise AssertionError(f"{run['name']} trained; it should have been refused")
        trainer.fit(model)
        if restore:
            restore()
        if remove_global_hook:
            remove_global_hook()
        rank = trainer.global_rank
        if summary and rank == 0:
            (out / "summary.txt").write_text(printed.text())
        if rank == 0:
            stages = trainer.strategy.stage_summary()
            (out / "stages.json").write_text(json.dumps({"module_name": stages.module_name,
                                                         "replicated": stages.replicated_parameters,
                                                         "replicated_share": stages.outside_share,
                                                         "outside": stages.outside,
                                                         "ranks": {row.stage: row.rank for row in stages.rows}}))
        torch.save(model.state_dict(), out / f"rank{rank}.pt")
        if run.get("save"):  # every rank takes part; global rank 0 writes the whole model as one file
            trainer.save_checkpoint(out / "model.ckpt")
        if run.get("validate"):  # the trained model's validation loss, reported on every rank
            trainer.limit_val_batches = 1.0  # fit skipped validation; validate every batch
            (out / f"validated{rank}.json").write_text(json.dumps(trainer.validate(model, verbose=False)))
        if run.get("predict"):  # in eval mode, without gradients: the last stage's predictions come back on rank 0
            predictions = trainer.predict(model)
            if rank == 0:
                torch.save(torch.cat(predictions), out / "predictions.pt")
        if hooks is not None:  # with where the strategy says each block ran
            rows = [{"rank": row.rank, "layers": list(row.blocks)} for row in trainer.strategy.stage_summary().rows]
            (out / f"hooks{rank}.json").write_text(json.dumps({"seen": hooks, "stages": rows}))
        (out / f"rank{rank}.json").write_text(json.dumps({"losses": losses.losses}))


if __name__ == "__main__":
    main(sys.argv[1])
