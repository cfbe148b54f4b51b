"""What trains as one device under GPipe trains so under the schedules that hold several model chunks per stage.

One launch of 2 processes runs every case under ``interleaved_1f1b`` (chunks ``k`` on stage ``k % 2``) or ``zbv``
(chunks in a V: stage 0 holds the first and the last): sequences whose length changes from batch to batch, forwards
kept without re-computation, weights shared by two chunks of one stage and of two stages, compiled layers, an
explicit balance over ``S·v`` chunks, and checkpoints written under one schedule and resumed under another. Each is
compared with one device; a loss that is a mean over samples makes that one device on the whole batch.
"""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer

from helpers.compare import merged_state_dict, rank_results, relative_weight_error, single_device_run
from helpers.launch import launch
from helpers.models import COMPILE_BACKEND, PipeClassifier, TiedAcrossStages, loaders
from lightning_pipe import GPipeStrategy
from lightning_pipe.sharded import is_sharded_checkpoint
from lightning_pipe.tied import TiedParameter, parameters_shared_across_stages

TOLERANCE = 1e-5  # of the total weight change during training
INTERLEAVED = {"schedule": "interleaved_1f1b"}  # 2 chunks per stage, 4 in all: layers 0-1, 2-3, 4-5, 6-7
ZBV = {"schedule": "zbv"}
RESUMED = {"model": "tied_momentum", "num_micro_batches": 4, "max_epochs": 2, "resume_after_epoch": True, "lr": 0.2}

RUNS = [
    {"name": "sequences_interleaved", "model": "sequences", "data": "sequences", "num_micro_batches": 4,
     "strategy": INTERLEAVED},
    # 50 samples: batches of 16 (micro-batches of 5, 5, 6) and a last batch of 2 (two micro-batches of 1).
    {"name": "sequences_zbv_uneven", "model": "sequences", "data": "sequences", "num_micro_batches": 3,
     "train_samples": 50, "strategy": ZBV},
    {"name": "never_interleaved", "num_micro_batches": 4, "checkpoint": "never", "strategy": INTERLEAVED},
    # TiedAcrossStages: layer 6 uses layer 2's weight. Interleaved: chunks 1 and 3, both on stage 1. ZB-V: chunk 1
    # on stage 1, chunk 3 on stage 0.
    {"name": "tied_interleaved", "model": "tied", "num_micro_batches": 4, "strategy": INTERLEAVED},
    {"name": "tied_zbv", "model": "tied", "num_micro_batches": 4, "trainer": {"gradient_clip_val": 0.05},
     "strategy": ZBV},
    {"name": "tied_zbv_unsummed", "model": "tied", "num_micro_batches": 4, "trainer": {"gradient_clip_val": 0.05},
     "strategy": ZBV, "unsummed_ties": True},  # negative control
    # Built on the meta device: stage 0 (layer 6, the last user) initialises the shared weight, as one device does.
    {"name": "tied_deferred_zbv", "model": "tied_deferred", "num_micro_batches": 4, "strategy": ZBV},
    {"name": "compiled_interleaved", "model": "compiled", "num_micro_batches": 2, "strategy": INTERLEAVED},
    {"name": "compiled_layers_zbv", "model": "compiled_layers", "num_micro_batches": 2, "strategy": ZBV},
    {"name": "compile_option_interleaved", "num_micro_batches": 2,
     "strategy": {**INTERLEAVED, "compile": {"backend": COMPILE_BACKEND}}},
    {"name": "balance_interleaved", "num_micro_batches": 4, "strategy": {**INTERLEAVED, "balance": [1, 3, 2, 2]}},
    # One epoch, a checkpoint (the shared weight's momentum in it), then a second epoch from that file.
    {**RESUMED, "name": "gpipe_then_interleaved", "first_strategy": {"schedule": "gpipe"}, "strategy": INTERLEAVED},
    {**RESUMED, "name": "interleaved_then_gpipe", "first_strategy": INTERLEAVED,
     "strategy": {"schedule": "gpipe", "save_distributed_checkpoint": True}},
    # ZB-V's loss is on stage 0, which global rank 0 holds: there the checkpoint gathers the whole model.
    {**RESUMED, "name": "zbv_then_interleaved", "first_strategy": ZBV, "strategy": INTERLEAVED},
    # Built on the meta device (each rank its own chunks), the whole trained model asked for on rank 0 after fit.
    {"name": "deferred_zbv_gathered", "model": "deferred", "num_micro_batches": 4,
     "strategy": {**ZBV, "gather_model_after_run": True}},
]


@pytest.fixture(scope="module")
def pipelined(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("schedules_features")
    launch("fits_worker.py", {"devices": 2, "out": str(tmp), "runs": RUNS}, tmp, timeout=900)
    return tmp, {run["name"]: run for run in RUNS}


def weight_error(tmp, run: dict, reference: dict | None = None) -> float:
    initial, expected, _ = single_device_run(reference or run)
    return relative_weight_error(initial, expected, merged_state_dict(tmp / run["name"]))


@pytest.mark.parametrize("name", ["sequences_interleaved", "sequences_zbv_uneven"])
def test_sequence_length_changing_between_batches_equals_one_device_on_the_whole_batch(pipelined, name):
    tmp, runs = pipelined
    assert weight_error(tmp, runs[name]) < TOLERANCE
    _, _, single = single_device_run(runs[name])
    for result in rank_results(tmp / name):
        assert result["train_losses"] == pytest.approx(single["train_losses"], rel=1e-5)


def test_forwards_kept_without_recomputation_equal_one_device(pipelined):
    tmp, runs = pipelined
    assert weight_error(tmp, runs["never_interleaved"]) < TOLERANCE


@pytest.mark.parametrize("name", ["tied_interleaved", "tied_zbv", "tied_deferred_zbv"])
def test_weight_shared_by_two_chunks_trains_as_on_one_device(pipelined, name):
    """Two chunks of one stage (interleaved), and of two stages with clipping by the global norm (ZB-V); built on
    the meta device, every copy starts from the value one device initialises."""
    tmp, runs = pipelined
    assert weight_error(tmp, runs[name]) < TOLERANCE  # merged_state_dict also checks that every copy is equal


def test_weight_shared_by_chunks_of_two_stages_goes_by_its_first_use_along_the_model():
    """ZB-V: stage 0 holds layers 0-1 and 6-7, stage 1 layers 2-5. Layer 6 uses layer 2's weight: one device calls
    it net.model.2.weight (checkpoints name every copy so) and layer 6 initialises it last."""
    layers = list(TiedAcrossStages().net.model)
    assert parameters_shared_across_stages(layers, [[0, 1, 6, 7], [2, 3, 4, 5]]) == [
        TiedParameter(stages=(1, 0), places=((2, "weight"), (6, "weight")), last_user=0)
    ]
    assert parameters_shared_across_stages(layers, [[0, 1, 4, 5], [2, 3, 6, 7]]) == []  # interleaved: one stage


def test_comparison_detects_shared_weight_gradients_left_unsummed_across_chunks(pipelined):
    tmp, runs = pipelined
    assert weight_error(tmp, runs["tied_zbv_unsummed"], runs["tied_zbv"]) > 100 * TOLERANCE


@pytest.mark.parametrize("name", ["compiled_interleaved", "compiled_layers_zbv", "compile_option_interleaved"])
def test_compiled_model_trains_as_on_one_device_with_each_chunk_compiled(pipelined, name):
    tmp, runs = pipelined
    reference = {**runs[name], "model": "classifier"} if name.startswith("compile_option") else runs[name]
    assert weight_error(tmp, runs[name], reference) < TOLERANCE
    for result in rank_results(tmp / name):
        assert result["compiled_graphs"] > 0, "a stage ran its layers uncompiled"


def test_explicit_balance_gives_each_chunk_its_layers_and_equals_one_device(pipelined):
    tmp, runs = pipelined
    run = runs["balance_interleaved"]
    for result in rank_results(tmp / run["name"]):
        assert result["chunk_ranges"] == [[0, 1], [1, 4], [4, 6], [6, 8]]
    assert weight_error(tmp, run, {**run, "strategy": {}}) < TOLERANCE


@pytest.mark.parametrize("name", ["gpipe_then_interleaved", "interleaved_then_gpipe", "zbv_then_interleaved"])
def test_checkpoint_written_under_one_schedule_resumes_under_another_as_uninterrupted_one_device(pipelined, name):
    """The checkpoint holds the model as one device would (the stages' chunks differ between the schedules); a
    sharded one too."""
    tmp, runs = pipelined
    (checkpoint,) = (tmp / name / "checkpoints").glob("*.ckpt")
    assert is_sharded_checkpoint(checkpoint) == (name == "interleaved_then_gpipe")
    assert weight_error(tmp, runs[name]) < TOLERANCE


def test_whole_model_asked_for_after_fit_comes_to_the_launching_process_under_zbv(pipelined):
    """Global rank 0 holds ZB-V's first stage (chunks 0 and 3); the chunks of stage 1 come to it after fit."""
    tmp, runs = pipelined
    run = runs["deferred_zbv_gathered"]
    gathered = torch.load(tmp / run["name"] / "rank0.pt")
    assert not any(value.is_meta for value in gathered.values())
    initial, expected, _ = single_device_run(run)
    assert relative_weight_error(initial, expected, gathered) < TOLERANCE


@pytest.mark.parametrize("num_stages", [2, None], ids=["num_stages_set", "stages_from_devices"])
def test_balance_of_one_count_per_stage_is_refused_naming_the_chunk_count(num_stages):
    message = (r"balance=\[4, 4\] has 2 entries but schedule='interleaved_1f1b' cuts the pipelined blocks into"
               r" num_stages \* virtual_stages = 2 \* 2 = 4 model chunks; give one layer count per chunk")
    with pytest.raises(ValueError, match=message):  # before any process starts
        strategy = GPipeStrategy(num_stages=num_stages, schedule="interleaved_1f1b", balance=[4, 4])
        Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False).fit(PipeClassifier(), *loaders(32, 16, 16))
    GPipeStrategy(num_stages=2, schedule="interleaved_1f1b", balance=[1, 3, 2, 2])  # one count per chunk
