"""Worker: several `Trainer.fit` runs with the gpipe strategy in one launch, results written per rank.

Usage: python fits_worker.py SPEC.json   (SPEC: {"devices": N, "out": DIR, "runs": [{"name": ..., ...}, ...]})
Each run writes DIR/NAME/rank{R}.pt (the rank's state dict) and DIR/NAME/rank{R}.json (losses, metrics); with
"record_dropout_masks", DIR/NAME/masks{R}.pt too (see `record_dropout_masks`).
"""

import atexit
import json
import os
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, Trainer, seed_everything
from lightning.pytorch.plugins import MixedPrecision
from torch import nn

import lightning_pipe
from helpers import models
from helpers.models import MODELS, loaders, sequence_loaders
from helpers.stock_models import padded_token_loaders
from helpers.negative_controls import (
    clip_one_ulp_apart,
    drop_gradient_of,
    record_clipping_norms,
    reduce_scatter_without_averaging,
)
from torch.distributed.tensor import DTensor
from helpers.recording import MetricRecorder
from lightning_pipe import auto_schedule
from lightning_pipe.execution import tied
from lightning_pipe.schedules.builtin import gpipe_schedule
from helpers.process_exit import skip_the_last_collection

skip_the_last_collection()  # in every process that runs this script, ranks included


def record_dropout_masks(model, rows):
    """``{name: [mask, ...]}``: which elements each ``nn.Dropout`` of ``model`` kept, one mask per call on a
    micro-batch (``rows`` samples) in training mode, in call order (with re-computation: a step's forwards, then their
    re-computations in backward). The model's own call of a stage's last block, which returns the joined batch, and
    the shape-only calls on the meta device are not draws of a mask."""
    masks = {}

    def recorder(name):
        def record(module, inputs, output):
            if module.training and not output.is_meta and len(output) == rows:
                masks.setdefault(name, []).append(output != 0)

        return record

    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout):
            module.register_forward_hook(recorder(name))
    return masks


def process_groups_left():
    """Whether torch.distributed is still initialised, and how many of gloo's threads still run in this process."""
    names = [Path(f"/proc/self/task/{task}/comm").read_text().strip() for task in os.listdir("/proc/self/task")]
    return {"initialized": dist.is_initialized(), "gloo_threads": sum(name.startswith(("gloo", "pt_gloo")) for name in names)}


def budget_below_the_fastest(record):
    """``schedule="auto"`` under a memory budget just below what its fastest configuration needs, derived from the
    profile the choice is made from: that profile ranked by the real ranking twice, without a budget and then with
    it. A budget taken from another run's choice need not exclude this run's fastest (each run profiles anew, and a
    loaded machine ranks differently). ``record`` gets the budget and the fastest configuration."""
    original = auto_schedule.ranked_choice

    def ranked(model, settings, num_stages, batch_size, memory_budget, candidates, *args, **kwargs):
        rows, fastest, _ = original(model, settings, num_stages, batch_size, None, candidates, *args, **kwargs)
        budget = min(row.memory_bytes for row in rows if row.step <= fastest.step) - 1  # any as fast excluded too
        record.update(memory_budget=budget, fastest=str(fastest.configuration), fastest_memory_bytes=fastest.memory_bytes)
        return original(model, settings, num_stages, batch_size, budget, candidates, *args, **kwargs)

    auto_schedule.ranked_choice = ranked
    return lambda: setattr(auto_schedule, "ranked_choice", original)


def leave_tied_gradients_unsummed():
    """Negative control: each stage updates its copy of a parameter shared between stages with its own gradient."""
    original = tied.TiedParameters.sum_gradients
    tied.TiedParameters.sum_gradients = lambda self: None
    return lambda: setattr(tied.TiedParameters, "sum_gradients", original)


class CollectiveCounter:
    """Counts FSDP2's all-gathers and reduce-scatters (``dist.all_gather_single``, ``dist.reduce_scatter_single``,
    which its collectives call) in each training step."""

    def __init__(self):
        self.per_step, self.current = [], {"all_gather": 0, "reduce_scatter": 0}
        self.outside_sharded = 0  # modules outside the blocks sharded on this rank (see StepEnds)
        self.dtypes = {"all_gather": set(), "reduce_scatter": set()}  # of the tensors sent
        self.originals = dist.all_gather_single, dist.reduce_scatter_single
        dist.all_gather_single = self._counted("all_gather", self.originals[0])
        dist.reduce_scatter_single = self._counted("reduce_scatter", self.originals[1])

    def _counted(self, kind, original):
        def call(output, input, *args, **kwargs):
            self.current[kind] += 1
            self.dtypes[kind].add(str(input.dtype))
            return original(output, input, *args, **kwargs)

        return call

    def step_ends(self):
        self.per_step.append(self.current)
        self.current = {"all_gather": 0, "reduce_scatter": 0}

    def restore(self):
        dist.all_gather_single, dist.reduce_scatter_single = self.originals


class StepEnds(Callback):
    """Marks the end of each training step for a :class:`CollectiveCounter`, and notes how many modules outside the
    blocks the stage shards (the sharding is undone after the run)."""

    def __init__(self, counter):
        self.counter = counter

    def on_train_batch_end(self, trainer, *args, **kwargs):
        self.counter.step_ends()
        sharding = trainer.strategy._pipeline.gradients.sharding  # the owner of the sharded stage
        self.counter.outside_sharded = len(sharding.outside) if sharding is not None else 0


def whole_state_dict(model):
    """The model's state dict with each tensor sharded over the replicas (FSDP2's DTensors) gathered whole: a
    collective over each stage's replicas, in the same key order on all of them."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}


def main(spec_path):
    spec = json.loads(Path(spec_path).read_text())
    # Registered before any run: it runs after lightning_pipe's own exit handler, and records what that left.
    exits = Path(spec["out"], "exits")
    exits.mkdir(exist_ok=True)
    atexit.register(lambda: (exits / str(os.getpid())).write_text(json.dumps(process_groups_left())))
    for run in spec["runs"]:
        if run.get("data") == "sequences":
            train, val = sequence_loaders(run.get("train_samples", 80), run.get("val_samples", 40), 16)
        elif run.get("data") == "padded_tokens":
            train, val = padded_token_loaders(run.get("train_samples", 80), run.get("val_samples", 40), 16)
        else:
            train, val = loaders(
                run.get("train_samples", 80), run.get("val_samples", 40), run.get("batch_size", 16),
                run.get("shuffle", False),
            )
        restore = drop_gradient_of(run["drop_gradient_of"]) if run.get("drop_gradient_of") is not None else None
        if run.get("unsummed_ties"):
            restore = leave_tied_gradients_unsummed()
        if run.get("clip_one_ulp_apart"):
            restore = clip_one_ulp_apart()
        if run.get("unaveraged_shards"):
            restore = reduce_scatter_without_averaging()
        norms = []
        undo_norms = record_clipping_norms(norms) if run.get("record_clipping_norms") else None
        counter = CollectiveCounter() if run.get("count_collectives") else None
        recorder = MetricRecorder()
        if run.get("schedule") == "backwards_in_forward_order":  # a test-only schedule, defined in its test
            from test_equivalence import backwards_in_forward_order

            run.setdefault("strategy", {})["schedule"] = backwards_in_forward_order
        if run.get("schedule") == "gpipe_split":  # GPipe with deferred weight gradients
            run.setdefault("strategy", {})["schedule"] = gpipe_schedule(split_backward=True)
        torch._dynamo.reset()  # an earlier run's compiled code would serve this run's layers of the same types
        graphs_before = dict(models.compiled_graphs)
        out = Path(spec["out"]) / run["name"]

        def trainer_for(max_epochs: int, checkpoints: bool, strategy: dict) -> Trainer:
            checkpoints = checkpoints or run.get("enable_checkpointing", False)
            return Trainer(
                strategy=lightning_pipe.GPipeStrategy(
                    num_micro_batches=run.get("num_micro_batches"),
                    checkpoint=run.get("checkpoint", "except_last"),
                    start_method=run.get("start_method", "popen"),
                    **strategy,
                ),
                accelerator="cpu",
                devices=spec["devices"],
                max_epochs=max_epochs,
                logger=False,
                enable_checkpointing=checkpoints,
                default_root_dir=str(out),
                enable_progress_bar=False,
                enable_model_summary=False,
                callbacks=[recorder] + ([StepEnds(counter)] if counter is not None else []),
                **run.get("trainer", {}),
                plugins=[MixedPrecision("16-mixed", "cpu")] if run.get("fp16") else None,
            )

        budget_record: dict = {}
        if run.get("memory_budget_below_fastest"):
            restore = budget_below_the_fastest(budget_record)
        checkpoint_path = None
        if run.get("resume_after_epoch"):  # train one epoch, writing a checkpoint; the run resumes from it below
            seed_everything(0)
            first = MODELS[run.get("model", "classifier")](lr=run.get("lr", 0.5))
            # "first_strategy": the first epoch's settings, where they differ (another schedule, say)
            trainer_for(1, True, {**run.get("strategy", {}), **run.get("first_strategy", {})}).fit(first, train, val)
            checkpoint_path = next((out / "checkpoints").glob("*.ckpt"))
            recorder = MetricRecorder()
        trainer = trainer_for(run.get("max_epochs", 1), False, run.get("strategy", {}))
        seed_everything(0 if checkpoint_path is None else 1)  # a resumed run must take its weights from the file
        with trainer.init_module(empty_init=True) if run.get("empty_init") else nullcontext():
            model = MODELS[run.get("model", "classifier")](lr=run.get("lr", 0.5))
        masks = None
        if run.get("record_dropout_masks"):
            masks = record_dropout_masks(model, run.get("batch_size", 16) // run["num_micro_batches"])
        # Re-computations then run to the end (not only as far as backward needs), so the hooks record them too.
        with torch.utils.checkpoint.set_checkpoint_early_stop(False) if masks is not None else nullcontext():
            try:
                trainer.fit(model, train, val, ckpt_path=checkpoint_path)
            except Exception as error:
                if not run.get("expect_error"):  # a run that must fail at set-up: its message, and no later run
                    raise
                out.mkdir(parents=True, exist_ok=True)
                (out / f"error{trainer.global_rank}.txt").write_text(f"{type(error).__name__}: {error}")
                return
        if restore:
            restore()
        if undo_norms is not None:
            undo_norms()
        if counter is not None:
            counter.restore()
        out.mkdir(parents=True, exist_ok=True)
        rank = trainer.global_rank
        torch.save(whole_state_dict(model), out / f"rank{rank}.pt")
        if masks is not None:
            torch.save(masks, out / f"masks{rank}.pt")
        if run.get("save_after_fit"):  # in the launching process of spawn/fork: the stages' optimizers are gone
            try:
                trainer.save_checkpoint(out / "after_fit.ckpt")
            except RuntimeError as error:
                (out / "save_error.txt").write_text(str(error))
            trainer.save_checkpoint(out / "weights.ckpt", weights_only=True)
        summary = recorder.summary()
        # Graphs torch.compile compiled in this run, per counted backend (see helpers.models.CompiledLayers).
        summary["compiled_graphs"] = {name: n - graphs_before[name] for name, n in models.compiled_graphs.items()}
        if run.get("record_clipping_norms"):
            summary["clipping_norms"] = norms
        pipeline = trainer.strategy._pipeline  # what was built (None in the launching process of spawn/fork)
        summary["held_blocks"] = pipeline.runtime.stage.indices if pipeline is not None else []
        plan = pipeline.plan if pipeline is not None else None
        if plan is not None:
            summary["chunk_ranges"] = [[r.start, r.stop] for r in plan.ranges]
        if hasattr(model, "forward_counts"):
            summary["forward_counts"] = model.forward_counts()
        if counter is not None:
            summary["collectives_per_step"] = counter.per_step
            blocks = pipeline.runtime.stage.blocks if pipeline is not None else []
            summary["blocks_with_parameters"] = sum(any(True for _ in block.parameters()) for block in blocks)
            summary["outside_sharded"] = counter.outside_sharded
            summary["collective_dtypes"] = {kind: sorted(dtypes) for kind, dtypes in counter.dtypes.items()}
            summary["stage_table"] = str(trainer.strategy.stage_summary())
        choice = pipeline.schedule_choice if pipeline is not None else None
        if choice is not None:  # schedule="auto": what it chose, as this rank runs it
            settings = trainer.strategy._settings
            summary["choice"] = {
                "schedule": settings.schedule.name, "num_micro_batches": settings.num_micro_batches,
                "virtual_stages": settings.virtual_stages, "checkpoint": settings.recompute,
                "chosen": str(choice.configuration), "memory_bytes": choice.memory_bytes,
                "memory_budget": run.get("strategy", {}).get("memory_budget"), "message": choice.message,
                **budget_record,  # on global rank 0, which chose: the budget and the fastest it excludes
            }
        (out / f"rank{rank}.json").write_text(json.dumps(summary))
        if rank == 0:  # which of Lightning's cluster environments set up the ranks
            (out / "environment.txt").write_text(type(trainer.strategy.cluster_environment).__name__)


if __name__ == "__main__":
    main(sys.argv[1])
