"""Models that could differ silently from one device do not: weights shared between stages, compiled modules,
re-computation, and sequences whose length changes from batch to batch."""

from __future__ import annotations

import pytest
from lightning.pytorch import Trainer

from helpers.compare import merged_state_dict, rank_results, relative_weight_error, single_device_run
from helpers.launch import launch
from helpers.models import COMPILE_BACKEND, CompiledAroundThePipeline, CompiledInPlace, TiedAcrossStages, loaders
from lightning_pipe import GPipeStrategy
from lightning_pipe.sharded import is_sharded_checkpoint
from lightning_pipe.tied import TiedParameter, parameters_shared_across_stages

TOLERANCE = 1e-5  # of the total weight change during training
M = 4

RUNS = [
    {"name": "tied", "model": "tied", "num_micro_batches": M},
    {"name": "tied_clip", "model": "tied", "num_micro_batches": M, "trainer": {"gradient_clip_val": 0.05}},
    {"name": "tied_deferred", "model": "tied_deferred", "num_micro_batches": M},
    {"name": "tied_unsummed", "model": "tied", "num_micro_batches": M, "unsummed_ties": True},  # negative control
    # Checkpointed after epoch 1 (the shared weight's momentum under its one-device name), resumed for epoch 2.
    {"name": "tied_resumed", "model": "tied_momentum", "num_micro_batches": M, "max_epochs": 2,
     "resume_after_epoch": True, "lr": 0.2},
    # The same through a sharded checkpoint: both stages write the shared weight's momentum under one name.
    {"name": "tied_resumed_sharded", "model": "tied_momentum", "num_micro_batches": M, "max_epochs": 2,
     "resume_after_epoch": True, "lr": 0.2, "strategy": {"save_distributed_checkpoint": True}},
    {"name": "tied_outside", "model": "tied_outside", "num_micro_batches": M, "trainer": {"gradient_clip_val": 0.05}},
    {"name": "tied_outside_only", "model": "tied_outside_only", "num_micro_batches": M},
    {"name": "compiled", "model": "compiled", "num_micro_batches": 2},
    {"name": "compiled_layers", "model": "compiled_layers", "num_micro_batches": 2},
    {"name": "compile_option", "num_micro_batches": 2, "strategy": {"compile": {"backend": COMPILE_BACKEND}}},
    {"name": "counts_always", "model": "counts", "num_micro_batches": M, "checkpoint": "always"},
    {"name": "counts_except_last", "model": "counts", "num_micro_batches": M, "checkpoint": "except_last"},
    {"name": "sequences", "model": "sequences", "data": "sequences", "num_micro_batches": M},
]


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("exactness")
    launch("fits_worker.py", {"devices": 2, "out": str(tmp), "runs": RUNS}, tmp)
    return tmp, {run["name"]: run for run in RUNS}


def weight_error(tmp, run: dict, reference: dict | None = None) -> float:
    initial, expected, _ = single_device_run(reference or run)
    return relative_weight_error(initial, expected, merged_state_dict(tmp / run["name"]))


@pytest.mark.parametrize("name", ["tied", "tied_clip", "tied_deferred"])
def test_parameter_shared_by_layers_of_two_stages_trains_as_on_one_device(pipelined, name):
    """Both stages hold layer 2's weight (layer 6 uses it too): gradients summed, the same update on both, clipping
    counts it once; built on the meta device, both copies start from the value one device initialises."""
    tmp, runs = pipelined
    assert weight_error(tmp, runs[name]) < TOLERANCE  # merged_state_dict also checks that both copies are equal


@pytest.mark.parametrize("name", ["tied_resumed", "tied_resumed_sharded"])
def test_checkpoint_with_a_shared_parameter_resumes_as_uninterrupted_training_on_one_device(pipelined, name):
    tmp, runs = pipelined
    (checkpoint,) = (tmp / name / "checkpoints").glob("*.ckpt")
    assert is_sharded_checkpoint(checkpoint) == (name == "tied_resumed_sharded")
    assert weight_error(tmp, runs[name]) < TOLERANCE


def test_comparison_detects_shared_parameter_gradients_left_unsummed(pipelined):
    tmp, runs = pipelined
    assert weight_error(tmp, runs["tied_unsummed"], runs["tied"]) > 100 * TOLERANCE


@pytest.mark.parametrize("name", ["tied_outside", "tied_outside_only"])
def test_parameter_tied_to_a_module_outside_the_pipeline_trains_as_on_one_device(pipelined, name):
    """A pipelined layer's weight shared with a module that runs on every stage; and GPT-2's tie of the input
    embedding to the output head, both outside the pipelined module."""
    tmp, runs = pipelined
    assert weight_error(tmp, runs[name]) < TOLERANCE


def test_shared_parameters_are_found_by_the_stages_that_use_them():
    model = TiedAcrossStages()
    layers = list(model.net.model)
    assert parameters_shared_across_stages(layers, [range(0, 4), range(4, 8)]) == [
        TiedParameter(stages=(0, 1), places=((2, "weight"), (6, "weight")), last_user=1)
    ]
    assert parameters_shared_across_stages(layers, [range(0, 7), range(7, 8)]) == []  # both users on stage 0


@pytest.mark.parametrize("name", ["compiled", "compiled_layers", "compile_option"])
def test_compiled_module_trains_as_on_one_device_with_each_stage_compiled(pipelined, name):
    """``torch.compile(seq)`` of the pipelined module, compiled layers, and ``GPipeStrategy(compile=...)``."""
    tmp, runs = pipelined
    reference = {**runs[name], "model": "classifier"} if name == "compile_option" else runs[name]
    assert weight_error(tmp, runs[name], reference) < TOLERANCE
    for result in rank_results(tmp / name):  # each stage compiled its own layers
        assert result["compiled_graphs"] > 0, "a stage ran its layers uncompiled"


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (CompiledInPlace, r"'net.model' was compiled in place .* GPipeStrategy\(compile=True\)"),
        (CompiledAroundThePipeline, r"'net' is compiled and contains the pipelined module 'net._orig_mod.model'"),
    ],
    ids=["in-place", "around-the-pipeline"],
)
def test_compilation_spanning_the_stages_is_refused_before_launch(model, message):
    trainer = Trainer(strategy=GPipeStrategy(), accelerator="cpu", devices=2, max_steps=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=message):  # in the launching process: no rank was started
        trainer.fit(model(), *loaders(32, 16, 16))


@pytest.mark.parametrize(("mode", "recomputed"), [("always", M), ("except_last", M - 1)])
def test_checkpoint_mode_recomputes_the_forward_of_each_micro_batch(pipelined, mode, recomputed):
    """Each layer runs once per micro-batch, plus once more in backward for each micro-batch it re-computes."""
    tmp, runs = pipelined
    run = runs[f"counts_{mode}"]
    _, _, single = single_device_run(run)
    steps = single["forward_counts"]["net.model.1"]  # one device: one call per step
    assert steps == 5
    calls: dict[str, int] = {}
    for result in rank_results(tmp / run["name"]):
        for layer, count in result["forward_counts"].items():
            calls[layer] = calls.get(layer, 0) + count  # a layer counts on the stage that holds it
    assert calls == {layer: steps * (M + recomputed) for layer in single["forward_counts"]}
    assert weight_error(tmp, run) < TOLERANCE


def test_sequence_length_changing_between_batches_matches_single_device(pipelined):
    tmp, runs = pipelined
    assert weight_error(tmp, runs["sequences"]) < TOLERANCE
    _, _, single = single_device_run(runs["sequences"])
    for result in rank_results(tmp / "sequences"):
        assert result["train_losses"] == pytest.approx(single["train_losses"], rel=1e-5)
