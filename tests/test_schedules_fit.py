"""Every schedule trains as one device does.

A per-micro-batch schedule calls ``training_step`` once per micro-batch and weights each loss by its micro-batch's
share of the batch: it equals one device with ``accumulate_grad_batches=M`` on batches of ``B/M``, and, for a loss
that is a mean over samples (the test model's cross-entropy), one device on the whole batch, whose logged loss it
logs too. GPipe with deferred weight gradients equals one device like GPipe.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

from helpers.compare import merged_state_dict, rank_results, relative_weight_error, single_device_run
from helpers.launch import launch, launches_started_with_first_test

TOLERANCE = 1e-5  # of the total weight change during training
PER_MICRO_BATCH = ("1f1b", "interleaved_1f1b", "zero_bubble", "zbv")
BATCH = 16


def runs_for(devices: int) -> list[dict]:
    runs = []
    for schedule in PER_MICRO_BATCH:
        strategy = {"schedule": schedule}
        runs += [
            {"name": f"{schedule}_m4", "num_micro_batches": 4, "strategy": strategy},
            # 50 samples in batches of 16: micro-batches of 5, 5, 6 samples; the last batch of 2 has 2 of 1.
            {"name": f"{schedule}_m3_uneven", "num_micro_batches": 3, "train_samples": 50, "strategy": strategy},
        ]
        if devices == 2:
            runs.append({"name": f"{schedule}_always", "num_micro_batches": 4, "checkpoint": "always",
                         "strategy": strategy})
    runs.append({"name": "gpipe_split", "num_micro_batches": 4, "schedule": "gpipe_split"})
    # Emulated devices (lightning_pipe.testing.emulate): a schedule deferring weight gradients, and GPipe deferring them.
    runs += [{"name": "emulated_zbv", "model": "emulated", "num_micro_batches": 4, "strategy": {"schedule": "zbv"}},
             {"name": "emulated_gpipe_split", "model": "emulated", "num_micro_batches": 4, "schedule": "gpipe_split"}]
    if devices == 4:
        # 50 steps of 16 samples with clipping (by a norm that every step exceeds) and the fp16 gradient scaler.
        fifty_steps = {"model": "tied_everywhere", "num_micro_batches": 4, "train_samples": 800, "lr": 0.01,
                       "fp16": True, "trainer": {"gradient_clip_val": 0.05}}
        runs += [{**fifty_steps, "name": "replicas_gpipe"},
                 {**fifty_steps, "name": "replicas_zbv", "strategy": {"schedule": "zbv"}},
                 # Negative control: ranks clipping by norms one ulp apart.
                 {**fifty_steps, "name": "replicas_ulp_apart", "train_samples": 160, "clip_one_ulp_apart": True}]
    if devices == 2:
        one_f_one_b = {"schedule": "1f1b"}
        runs += [
            {"name": "interleaved_v3", "num_micro_batches": 4,
             "strategy": {"schedule": "interleaved_1f1b", "virtual_stages": 3}},
            {"name": "accumulate", "num_micro_batches": 2, "trainer": {"accumulate_grad_batches": 2}, "strategy": one_f_one_b},
            {"name": "clip_norm", "num_micro_batches": 4, "trainer": {"gradient_clip_val": 0.05}, "strategy": one_f_one_b},
            {"name": "skips", "model": "skips", "num_micro_batches": 4, "strategy": one_f_one_b},
            {"name": "skips_before", "model": "skips_before", "num_micro_batches": 4,
             "strategy": {"schedule": "interleaved_1f1b"}},
            {"name": "skips_some", "model": "skips_some", "num_micro_batches": 4, "strategy": {"schedule": "zbv"}},
            {"name": "fp16_overflow", "model": "poisoned", "num_micro_batches": 4, "fp16": True, "strategy": one_f_one_b},
            {"name": "dropped", "num_micro_batches": 4, "drop_gradient_of": 1, "strategy": {"schedule": "zero_bubble"}},
        ]
        # A Llama's token mean on right-padded batches of varying lengths: every schedule, its LightningModule
        # saying what the loss averages over (items_in_loss); the negative control weights by samples (its
        # items_in_loss counting them: without one, the strategy counts the Hugging Face model's labels, see
        # tests/test_micro_batch_weights.py).
        token_mean = {"model": "token_mean_llama", "data": "padded_tokens", "num_micro_batches": 4, "lr": 3e-3,
                      "train_samples": 48, "val_samples": 16}
        runs += [{**token_mean, "name": f"{schedule}_token_mean", "strategy": {"schedule": schedule}}
                 for schedule in ("gpipe", *PER_MICRO_BATCH)]
        runs.append({**token_mean, "model": "sample_weighted_llama", "name": "1f1b_sample_weighted",
                     "strategy": one_f_one_b})
    return runs


def launched(devices: int, tmp: Path):
    runs = runs_for(devices)
    launch("fits_worker.py", {"devices": devices, "out": str(tmp), "runs": runs}, tmp, timeout=900)
    return devices, tmp, {run["name"]: run for run in runs}


# Every launch of this file, started together with its first test.
launches = launches_started_with_first_test(
    ("pipelined",), lambda tmp: {n: partial(launched, n, tmp.mktemp(f"schedules{n}")) for n in (2, 4)}
)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}procs")
def pipelined(request, launches):
    return launches[request.param].result()


_references: dict[tuple, tuple] = {}


def reference(run: dict, **changes):
    run = {**run, **changes}
    keys = ("model", "train_samples", "max_epochs", "lr", "fp16", "batch_size")
    key = (*(run.get(k) for k in keys), tuple(sorted(run.get("trainer", {}).items())))
    if key not in _references:
        _references[key] = single_device_run(run)
    return _references[key]


def weight_error(tmp, run, **reference_changes) -> float:
    initial, expected, _ = reference(run, **reference_changes)
    return relative_weight_error(initial, expected, merged_state_dict(tmp / run["name"]))


def assert_equals_the_whole_batch(tmp, run):
    """One device on the whole batch: the weights, and the loss logged at every step and at the end."""
    assert weight_error(tmp, run) < TOLERANCE
    _, _, expected = reference(run)
    for result in rank_results(tmp / run["name"]):
        assert result["train_losses"] == pytest.approx(expected["train_losses"], rel=1e-5)
        for key in ("train_loss", "val_loss"):
            assert result["final_metrics"][key] == pytest.approx(expected["final_metrics"][key], rel=1e-5)


@pytest.mark.parametrize("schedule", PER_MICRO_BATCH)
def test_per_micro_batch_schedule_equals_one_device_accumulating_micro_batches(pipelined, schedule):
    _, tmp, runs = pipelined
    run = runs[f"{schedule}_m4"]
    trainer = {"accumulate_grad_batches": 4, **run.get("trainer", {})}
    assert weight_error(tmp, run, batch_size=BATCH // 4, trainer=trainer) < TOLERANCE


@pytest.mark.parametrize("schedule", PER_MICRO_BATCH)
def test_per_micro_batch_schedule_equals_one_device_on_the_whole_batch(pipelined, schedule):
    _, tmp, runs = pipelined
    assert_equals_the_whole_batch(tmp, runs[f"{schedule}_m4"])


@pytest.mark.parametrize("schedule", ("gpipe", *PER_MICRO_BATCH))
def test_a_token_mean_on_padded_batches_equals_one_device_on_the_whole_batch(pipelined, schedule):
    """Micro-batches holding different numbers of label tokens, each weighted by its share of the batch's tokens
    (the LightningModule's ``items_in_loss``): the whole batch's token mean, as one device computes it."""
    devices, tmp, runs = pipelined
    if devices != 2:
        pytest.skip("run on 2 stages")
    assert weight_error(tmp, runs[f"{schedule}_token_mean"]) < TOLERANCE


def test_sample_weighting_of_a_token_mean_on_padded_batches_differs_from_one_device(pipelined):
    """Negative control: the same model and data, its ``items_in_loss`` counting samples."""
    devices, tmp, runs = pipelined
    if devices != 2:
        pytest.skip("run on 2 stages")
    assert weight_error(tmp, runs["1f1b_sample_weighted"]) > 100 * TOLERANCE


@pytest.mark.parametrize("schedule", PER_MICRO_BATCH)
def test_uneven_micro_batches_and_a_smaller_last_batch_equal_one_device(pipelined, schedule):
    _, tmp, runs = pipelined
    assert_equals_the_whole_batch(tmp, runs[f"{schedule}_m3_uneven"])


@pytest.mark.parametrize("schedule", PER_MICRO_BATCH)
def test_recomputed_forwards_equal_one_device(pipelined, schedule):
    devices, tmp, runs = pipelined
    if devices != 2:
        pytest.skip("checked with 2 stages")
    assert_equals_the_whole_batch(tmp, runs[f"{schedule}_always"])


@pytest.mark.parametrize("name", ["emulated_zbv", "emulated_gpipe_split"])
def test_a_model_of_emulated_blocks_trains_as_one_device(pipelined, name):
    """Blocks whose compute is a wait (``lightning_pipe.testing.emulate``), the last twice as heavy, under a zero-bubble
    schedule and under GPipe with deferred weight gradients."""
    _, tmp, runs = pipelined
    assert_equals_the_whole_batch(tmp, runs[name])


def test_gpipe_with_deferred_weight_gradients_equals_one_device(pipelined):
    _, tmp, runs = pipelined
    assert_equals_the_whole_batch(tmp, runs["gpipe_split"])


@pytest.mark.parametrize("name", ["interleaved_v3", "accumulate", "clip_norm", "skips", "skips_before"])
def test_lightning_features_under_a_per_micro_batch_schedule_equal_one_device(pipelined, name):
    """Three chunks per stage; Lightning's accumulation on top; clipping by the global norm; a step returning None
    after the model ran, and before it ran."""
    devices, tmp, runs = pipelined
    if devices != 2:
        pytest.skip("checked with 2 stages")
    assert weight_error(tmp, runs[name]) < TOLERANCE


def test_micro_batches_whose_step_returns_none_are_skipped_on_every_stage(pipelined):
    """Three of the twenty micro-batches return before calling the model: as one device accumulating micro-batches,
    they add no gradient."""
    devices, tmp, runs = pipelined
    if devices != 2:
        pytest.skip("checked with 2 stages")
    run = runs["skips_some"]
    assert weight_error(tmp, run, batch_size=BATCH // 4, trainer={"accumulate_grad_batches": 4}) < TOLERANCE


def test_an_overflow_on_one_stage_skips_the_step_everywhere_under_a_per_micro_batch_schedule(pipelined):
    devices, tmp, runs = pipelined
    if devices != 2:
        pytest.skip("checked with 2 stages")
    run = runs["fp16_overflow"]
    _, _, expected = reference(run)
    assert expected["grad_scale"] == 2.0**15  # one skipped step halved the initial 2**16
    assert {result["grad_scale"] for result in rank_results(tmp / run["name"])} == {expected["grad_scale"]}
    assert weight_error(tmp, run) < 1e-2  # float16 products, summed per micro-batch: as tests/test_equivalence.py


@pytest.mark.parametrize("name", ["replicas_gpipe", "replicas_zbv"])
def test_replicated_parameters_stay_bit_identical_on_every_rank_for_50_steps(pipelined, name):
    """A head tied to the input embedding (held by all 4 stages) and a weight shared by two stages, clipped by the
    global norm at every step, under the fp16 gradient scaler, with Adam: after 50 steps every copy of every shared
    tensor holds the same bits on every rank (`merged_state_dict` checks it), and the model trained as one device."""
    devices, tmp, runs = pipelined
    if devices != 4:
        pytest.skip("checked with 4 stages")
    run = runs[name]
    results = rank_results(tmp / run["name"])
    assert [len(result["train_losses"]) for result in results] == [50] * 4
    initial, expected, _ = reference(run)
    merged = merged_state_dict(tmp / run["name"])  # raises if any copy differs between ranks
    for key in ("embed.weight", "to_embedding.weight", "net.model.2.weight"):
        assert not torch.equal(merged[key], initial[key])
    # One device clips and scales the same: fp16 products over 50 Adam steps agree to a few parts in a thousand.
    assert relative_weight_error(initial, expected, merged) < 1e-2


def test_bit_identity_check_detects_ranks_clipping_one_ulp_apart(pipelined):
    devices, tmp, runs = pipelined
    if devices != 4:
        pytest.skip("checked with 4 stages")
    with pytest.raises(AssertionError, match="differs between ranks"):
        merged_state_dict(tmp / "replicas_ulp_apart")


def test_comparison_detects_a_dropped_micro_batch_gradient(pipelined):
    devices, tmp, runs = pipelined
    if devices != 2:
        pytest.skip("checked with 2 stages")
    assert weight_error(tmp, runs["dropped"]) > 100 * TOLERANCE
