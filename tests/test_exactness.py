"""Models that could differ silently from one device do not: weights shared between stages, compiled modules,
re-computation, sequences whose length changes from batch to batch, and checkpoints; under GPipe and under the
schedules that hold two chunks per stage (``interleaved_1f1b``: chunk ``k`` on stage ``k % 2``; ``zbv``: in a V,
stage 0 holding the first and the last chunk), whose loss per micro-batch equals one device's for the mean losses
here."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer

from helpers.compare import merged_state_dict, rank_results, relative_weight_error, single_device_run
from helpers.launch import launch
from helpers.models import (
    COMPILE_BACKEND,
    WRAPPER_BACKEND,
    CompiledAroundThePipeline,
    CompiledInPlace,
    TiedAcrossStages,
    loaders,
)
from lightning_pipe import GPipeStrategy
from lightning_pipe.checkpoints.sharded import is_sharded_checkpoint
from lightning_pipe.execution.tied import TiedParameter, parameters_shared_across_stages

TOLERANCE = 1e-5  # of the total weight change during training
M = 4
INTERLEAVED = {"schedule": "interleaved_1f1b"}  # 4 chunks of the 8 layers: 0-1 and 4-5 on stage 0, 2-3 and 6-7 on 1
ZBV = {"schedule": "zbv"}  # 0-1 and 6-7 on stage 0, 2-3 and 4-5 on stage 1
RESUMED = {"model": "tied_momentum", "num_micro_batches": M, "max_epochs": 2, "resume_after_epoch": True, "lr": 0.2}

RUNS = [
    {"name": "tied", "model": "tied", "num_micro_batches": M},
    {"name": "tied_clip", "model": "tied", "num_micro_batches": M, "trainer": {"gradient_clip_val": 0.05}},
    {"name": "tied_deferred", "model": "tied_deferred", "num_micro_batches": M},
    {"name": "tied_unsummed", "model": "tied", "num_micro_batches": M, "unsummed_ties": True},  # negative control
    # Layer 6 uses layer 2's weight: interleaved, two chunks of stage 1; ZB-V, chunks of two stages, whose first user
    # along the model is stage 1 and last user stage 0 (which initialises it when built on the meta device).
    {"name": "tied_interleaved", "model": "tied", "num_micro_batches": M, "strategy": INTERLEAVED},
    {"name": "tied_zbv", "model": "tied", "num_micro_batches": M, "trainer": {"gradient_clip_val": 0.05},
     "strategy": ZBV},
    {"name": "tied_zbv_unsummed", "model": "tied", "num_micro_batches": M, "trainer": {"gradient_clip_val": 0.05},
     "strategy": ZBV, "unsummed_ties": True},  # negative control
    {"name": "tied_deferred_zbv", "model": "tied_deferred", "num_micro_batches": M, "strategy": ZBV},
    # Checkpointed after epoch 1 (the shared weight's momentum under its one-device name), resumed for epoch 2.
    {**RESUMED, "name": "tied_resumed"},
    # The same through a sharded checkpoint: both stages write the shared weight's momentum under one name.
    {**RESUMED, "name": "tied_resumed_sharded", "strategy": {"save_distributed_checkpoint": True}},
    # Written under one schedule, resumed under another (the stages hold other layers); ZB-V's loss stage is stage 0,
    # on global rank 0, which gathers the checkpoint.
    {**RESUMED, "name": "gpipe_then_interleaved", "first_strategy": {"schedule": "gpipe"}, "strategy": INTERLEAVED},
    {**RESUMED, "name": "interleaved_then_gpipe", "first_strategy": INTERLEAVED,
     "strategy": {"schedule": "gpipe", "save_distributed_checkpoint": True}},
    {**RESUMED, "name": "zbv_then_interleaved", "first_strategy": ZBV, "strategy": INTERLEAVED},
    # Built on the meta device (each rank its own chunks), the whole trained model asked for on rank 0 after fit.
    {"name": "deferred_zbv_gathered", "model": "deferred", "num_micro_batches": M,
     "strategy": {**ZBV, "gather_model_after_run": True}},
    {"name": "tied_outside", "model": "tied_outside", "num_micro_batches": M, "trainer": {"gradient_clip_val": 0.05}},
    {"name": "tied_outside_only", "model": "tied_outside_only", "num_micro_batches": M},
    {"name": "compiled", "model": "compiled", "num_micro_batches": 2},
    {"name": "compiled_layers", "model": "compiled_layers", "num_micro_batches": 2},
    {"name": "compile_option", "num_micro_batches": 2, "strategy": {"compile": {"backend": COMPILE_BACKEND}}},
    {"name": "compiled_interleaved", "model": "compiled", "num_micro_batches": 2, "strategy": INTERLEAVED},
    {"name": "compiled_layers_zbv", "model": "compiled_layers", "num_micro_batches": 2, "strategy": ZBV},
    {"name": "compile_option_interleaved", "num_micro_batches": 2,
     "strategy": {**INTERLEAVED, "compile": {"backend": COMPILE_BACKEND}}},
    {"name": "counts_always", "model": "counts", "num_micro_batches": M, "checkpoint": "always"},
    {"name": "counts_except_last", "model": "counts", "num_micro_batches": M, "checkpoint": "except_last"},
    {"name": "counts_never", "model": "counts", "num_micro_batches": M, "checkpoint": "never", "strategy": INTERLEAVED},
    {"name": "sequences", "model": "sequences", "data": "sequences", "num_micro_batches": M},
    {"name": "sequences_interleaved", "model": "sequences", "data": "sequences", "num_micro_batches": M,
     "strategy": INTERLEAVED},
    # 50 samples: batches of 16 (micro-batches of 5, 5, 6) and a last batch of 2 (two micro-batches of 1).
    {"name": "sequences_zbv_uneven", "model": "sequences", "data": "sequences", "num_micro_batches": 3,
     "train_samples": 50, "strategy": ZBV},
    {"name": "balance_interleaved", "num_micro_batches": M, "strategy": {**INTERLEAVED, "balance": [1, 3, 2, 2]}},
]


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("exactness")
    launch("fits_worker.py", {"devices": 2, "out": str(tmp), "runs": RUNS}, tmp, timeout=900)
    return tmp, {run["name"]: run for run in RUNS}


def weight_error(tmp, run: dict, reference: dict | None = None) -> float:
    initial, expected, _ = single_device_run(reference or run)
    return relative_weight_error(initial, expected, merged_state_dict(tmp / run["name"]))


@pytest.mark.parametrize(
    "name", ["tied", "tied_clip", "tied_deferred", "tied_interleaved", "tied_zbv", "tied_deferred_zbv"]
)
def test_parameter_shared_by_layers_of_two_stages_trains_as_on_one_device(pipelined, name):
    """Both stages hold layer 2's weight (layer 6 uses it too): gradients summed, the same update on both, clipping
    counts it once; built on the meta device, both copies start from the value one device initialises. Under
    interleaved 1F1B both layers are on one stage, in two chunks."""
    tmp, runs = pipelined
    assert weight_error(tmp, runs[name]) < TOLERANCE  # merged_state_dict also checks that both copies are equal


@pytest.mark.parametrize(
    "name",
    ["tied_resumed", "tied_resumed_sharded", "gpipe_then_interleaved", "interleaved_then_gpipe", "zbv_then_interleaved"],
)
def test_checkpoint_with_a_shared_parameter_resumes_as_uninterrupted_training_on_one_device(pipelined, name):
    """Under the schedule that wrote it or another: a checkpoint holds the model as one device would."""
    tmp, runs = pipelined
    (checkpoint,) = (tmp / name / "checkpoints").glob("*.ckpt")
    assert is_sharded_checkpoint(checkpoint) == (name in ("tied_resumed_sharded", "interleaved_then_gpipe"))
    assert weight_error(tmp, runs[name]) < TOLERANCE


def test_whole_model_asked_for_after_fit_comes_to_the_launching_process_under_zbv(pipelined):
    """Global rank 0 holds ZB-V's stage 0 (chunks 0 and 3); the chunks of stage 1 come to it after fit."""
    tmp, runs = pipelined
    run = runs["deferred_zbv_gathered"]
    gathered = torch.load(tmp / run["name"] / "rank0.pt")
    assert not any(value.is_meta for value in gathered.values())
    initial, expected, _ = single_device_run(run)
    assert relative_weight_error(initial, expected, gathered) < TOLERANCE


@pytest.mark.parametrize(("name", "reference"), [("tied_unsummed", "tied"), ("tied_zbv_unsummed", "tied_zbv")])
def test_comparison_detects_shared_parameter_gradients_left_unsummed(pipelined, name, reference):
    tmp, runs = pipelined
    assert weight_error(tmp, runs[name], runs[reference]) > 100 * TOLERANCE


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
    # ZB-V's chunks: stage 1 (layers 2-5) uses it first along the model, which names it; stage 0 (layer 6) last.
    assert parameters_shared_across_stages(layers, [[0, 1, 6, 7], [2, 3, 4, 5]]) == [
        TiedParameter(stages=(1, 0), places=((2, "weight"), (6, "weight")), last_user=0)
    ]
    assert parameters_shared_across_stages(layers, [[0, 1, 4, 5], [2, 3, 6, 7]]) == []  # interleaved: one stage


@pytest.mark.parametrize(
    "name",
    ["compiled", "compiled_layers", "compile_option", "compiled_interleaved", "compiled_layers_zbv",
     "compile_option_interleaved"],
)
def test_compiled_module_trains_as_on_one_device_with_each_stage_compiled(pipelined, name):
    """``torch.compile(seq)`` of the pipelined module, compiled layers, and ``GPipeStrategy(compile=...)``."""
    tmp, runs = pipelined
    reference = {**runs[name], "model": "classifier"} if name.startswith("compile_option") else runs[name]
    assert weight_error(tmp, runs[name], reference) < TOLERANCE
    for result in rank_results(tmp / name):  # each stage compiled its own layers
        graphs, held = result["compiled_graphs"], set(result["held_blocks"])
        assert sum(graphs.values()) > 0, "a stage ran its layers uncompiled"
        if name.startswith("compiled_layers"):  # each form compiled on the stage holding it, the loss stage too
            # (which probes the step on the meta device, under dispatch modes that torch.compile refuses to trace)
            assert (graphs[WRAPPER_BACKEND] > 0) == (0 in held), f"torch.compile(layer) on blocks {sorted(held)}"
            assert (graphs[COMPILE_BACKEND] > 0) == bool(held & {2, 3, 4, 5}), f"block.compile() on {sorted(held)}"


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


@pytest.mark.parametrize(("mode", "recomputed"), [("always", M), ("except_last", M - 1), ("never", 0)])
def test_checkpoint_mode_recomputes_the_forward_of_each_micro_batch(pipelined, mode, recomputed):
    """Each layer runs once per micro-batch, plus once more in backward for each micro-batch it re-computes
    (``never``: under interleaved 1F1B, each layer in its chunk)."""
    tmp, runs = pipelined
    run = runs[f"counts_{mode}"]
    _, _, single = single_device_run(run)
    steps = single["forward_counts"].pop("training_step")  # one device: one call per step
    assert steps == single["forward_counts"]["net.model.1"] == 5
    calls: dict[str, int] = {}
    user_steps = []
    for result in rank_results(tmp / run["name"]):
        user_steps.append(result["forward_counts"].pop("training_step"))
        for layer, count in result["forward_counts"].items():
            calls[layer] = calls.get(layer, 0) + count  # a layer counts on the stage that holds it
    assert calls == {layer: steps * (M + recomputed) for layer in single["forward_counts"]}
    assert weight_error(tmp, run) < TOLERANCE
    if mode == "never":
        # Interleaved: the user's step runs once per micro-batch on the stage of chunks 0 and 2 (its run for chunk 0
        # records chunk 2's call), and on the stage of chunks 1 and 3 once per micro-batch for chunk 3 (which returns
        # the micro-batch's output to the step, which computes the loss) but once per step for chunk 1: called with
        # chunk 0's output alone, its first call runs every micro-batch (see MicroBatchStep).
        assert sorted(user_steps) == [steps * M, steps * (M + 1)]
    else:
        assert user_steps == [steps, steps]  # GPipe: once per step on every stage


@pytest.mark.parametrize("name", ["sequences", "sequences_interleaved", "sequences_zbv_uneven"])
def test_sequence_length_changing_between_batches_matches_single_device(pipelined, name):
    """Under ZB-V with uneven micro-batches and a last batch of 2 samples."""
    tmp, runs = pipelined
    assert weight_error(tmp, runs[name]) < TOLERANCE
    _, _, single = single_device_run(runs[name])
    for result in rank_results(tmp / name):
        assert result["train_losses"] == pytest.approx(single["train_losses"], rel=1e-5)


def test_explicit_balance_gives_each_chunk_its_layers_and_equals_one_device(pipelined):
    tmp, runs = pipelined
    run = runs["balance_interleaved"]
    for result in rank_results(tmp / run["name"]):
        assert result["chunk_ranges"] == [[0, 1], [1, 4], [4, 6], [6, 8]]
    assert weight_error(tmp, run, {**run, "strategy": {}}) < TOLERANCE
