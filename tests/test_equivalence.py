"""Pipelined training ends with the weights, losses and metrics of the same training on one device."""

from __future__ import annotations

import itertools
import json
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from helpers.compare import merged_state_dict, rank_results, relative_weight_error, single_device_run
from helpers.launch import launch, launches_started_with_first_test
from lightning_pipe.schedules.actions import Action
from lightning_pipe.schedules.builtin import gpipe

TOLERANCE = 1e-5  # of the total weight change during training
MICRO_BATCHES = (1, 3, 4, 8)
MODES = ("always", "except_last", "never")
DROPOUT_MICRO_BATCHES = 4
DROPOUT_STEPS = 15  # 3 epochs of 80 samples in batches of 16


def runs_for(devices: int) -> list[dict]:
    runs = [
        {"name": f"m{m}_{mode}", "num_micro_batches": m, "checkpoint": mode}
        for m in MICRO_BATCHES
        for mode in MODES
    ]
    # 50 samples in batches of 16: the last batch has 2 samples, fewer than M = 4.
    runs.append({"name": "uneven", "num_micro_batches": 4, "train_samples": 50, "max_epochs": 2})
    runs += [
        {"name": "tuple", "model": "tuple", "num_micro_batches": 3},
        {"name": "skips", "model": "skips", "num_micro_batches": 4},
        {"name": "clip_norm", "num_micro_batches": 4, "trainer": {"gradient_clip_val": 0.05}},
        {"name": "clip_value", "num_micro_batches": 4,
         "trainer": {"gradient_clip_val": 0.01, "gradient_clip_algorithm": "value"}},
        {"name": "accumulate", "num_micro_batches": 2, "trainer": {"accumulate_grad_batches": 2}},
    ]
    runs += [
        {"name": "bf16", "num_micro_batches": 4, "trainer": {"precision": "bf16-mixed"}},
        {"name": "fp16_overflow", "model": "poisoned", "num_micro_batches": 4, "fp16": True},
    ]
    # BatchNorm: re-computation must not update running statistics twice; deferred statistics equal one device's
    # (with lr=0 the weights stay put, so five steps of running statistics can be compared exactly; one BatchNorm,
    # since a later one's input depends on an earlier one normalising per micro-batch).
    runs += [
        {"name": "bn_always", "model": "batchnorm", "num_micro_batches": 4, "checkpoint": "always"},
        {"name": "bn_never", "model": "batchnorm", "num_micro_batches": 4, "checkpoint": "never"},
        {"name": "bn_deferred", "model": "one_batchnorm", "num_micro_batches": 4, "lr": 0.0,
         "strategy": {"deferred_batch_norm": True}},
        {"name": "bn_per_micro_batch", "model": "one_batchnorm", "num_micro_batches": 4, "lr": 0.0},
    ]
    # Shuffled data and dropout on one stage only: the stages must still read the same batches every epoch.
    runs.append({"name": "shuffled_dropout", "model": "dropout", "num_micro_batches": 2, "shuffle": True,
                 "max_epochs": 3, "train_samples": 48})
    # Dropout in every stage's layers (see "Dropout" below): twice alike, and with every forward re-computed.
    dropout = {"model": "two_dropouts", "num_micro_batches": DROPOUT_MICRO_BATCHES, "max_epochs": 3,
               "record_dropout_masks": True}
    runs += [
        {"name": "dropout", **dropout, "checkpoint": "never"},
        {"name": "dropout_again", **dropout, "checkpoint": "never"},
        {"name": "dropout_recomputed", **dropout, "checkpoint": "always"},
    ]
    # A second schedule, defined in this test module and passed as the `schedule` setting (see below).
    runs.append({"name": "backwards_in_forward_order", "num_micro_batches": 4, "schedule": "backwards_in_forward_order"})
    # Negative control: one micro-batch's gradient dropped; the comparison must see it.
    runs.append({"name": "dropped", "num_micro_batches": 4, "drop_gradient_of": 1})
    return runs


def backwards_in_forward_order(
    stage: int, num_stages: int, num_micro_batches: int, virtual_stages: int
) -> list[Action]:
    """A test-only schedule: GPipe, with every stage running the backwards in forward order (0 first). Adding it
    took this function and the `schedule` setting, nothing else."""
    actions = gpipe(stage, num_stages, num_micro_batches, virtual_stages)
    forwards = [a for a in actions if a.kind in ("recv", "forward", "send")]
    backwards = [a for a in actions if a not in forwards]
    return forwards + sorted(backwards, key=lambda action: action.micro_batch)  # stable: recv, run, send per m


def launched(devices: int, tmp: Path) -> tuple[int, Path, dict[str, dict]]:
    runs = runs_for(devices)
    launch("fits_worker.py", {"devices": devices, "out": str(tmp), "runs": runs}, tmp)
    return devices, tmp, {run["name"]: run for run in runs}


# The 2- and 4-process launches, started together with the file's first test.
launches = launches_started_with_first_test(
    ("pipelined",), lambda tmp: {n: partial(launched, n, tmp.mktemp(f"equivalence{n}")) for n in (2, 4)}
)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}procs")
def pipelined(request, launches):
    return launches[request.param].result()


def test_the_gradient_scaler_lets_go_of_the_pipeline_group_when_the_strategy_releases_it():
    """The 16-mixed overflow agreement holds the pipeline's group in the scaler; a Trainer that outlives the run
    (Lightning 2.4 keeps one to the end) would keep that group's threads running at exit."""
    import weakref

    from lightning_pipe.execution.gradients import agree_on_gradient_overflow, stop_agreeing_on_gradient_overflow

    class Group:  # stands in for the group: only its lifetime is checked
        pass

    scaler, group = torch.amp.GradScaler("cpu"), Group()
    alive = weakref.ref(group)
    agree_on_gradient_overflow(scaler, group, torch.device("cpu"))
    del group
    assert alive() is not None and "unscale_" in scaler.__dict__
    stop_agreeing_on_gradient_overflow(scaler)
    assert alive() is None and "unscale_" not in scaler.__dict__
    scaler.unscale_ = print  # someone else's: left alone
    stop_agreeing_on_gradient_overflow(scaler)
    assert scaler.__dict__["unscale_"] is print


def test_every_rank_destroys_its_process_groups_at_exit(pipelined):
    """A group left to the interpreter's final clean-up can abort a finished run (exit code -6)."""
    devices, tmp, _ = pipelined
    # The launch returns when the launching process (rank 0) has ended; the ranks it started may still be exiting.
    deadline = time.monotonic() + 60
    while len(list((tmp / "exits").iterdir())) < devices and time.monotonic() < deadline:
        time.sleep(0.2)
    states = [json.loads(path.read_text()) for path in (tmp / "exits").iterdir()]
    assert states == [{"initialized": False, "gloo_threads": 0}] * devices


_references: dict[tuple, tuple] = {}


def reference(run: dict):
    keys = ("model", "train_samples", "max_epochs", "lr", "fp16")
    key = (*(run.get(k) for k in keys), tuple(sorted(run.get("trainer", {}).items())))
    if key not in _references:
        _references[key] = single_device_run(run)
    return _references[key]


def assert_matches_single_device(tmp, run):
    initial, expected, expected_metrics = reference(run)
    error = relative_weight_error(initial, expected, merged_state_dict(tmp / run["name"]))
    assert error < TOLERANCE, f"weights differ from one device by {error:.2e} of their change"
    for result in rank_results(tmp / run["name"]):  # every rank sees what one device logs
        assert result["train_losses"] == pytest.approx(expected_metrics["train_losses"], rel=1e-5)
        for key in ("train_loss", "val_loss"):
            assert result["final_metrics"][key] == pytest.approx(expected_metrics["final_metrics"][key], rel=1e-5)


@pytest.mark.parametrize("m", MICRO_BATCHES)
@pytest.mark.parametrize("mode", MODES)
def test_weights_and_losses_match_single_device(pipelined, m, mode):
    _, tmp, runs = pipelined
    assert_matches_single_device(tmp, runs[f"m{m}_{mode}"])


def test_last_smaller_batch_matches_single_device(pipelined):
    _, tmp, runs = pipelined
    assert_matches_single_device(tmp, runs["uneven"])


@pytest.mark.parametrize("name", ["tuple", "skips", "clip_norm", "clip_value", "accumulate"])
def test_model_and_trainer_variants_match_single_device(pipelined, name):
    """Tuple activations with a mask, skipped steps, clipping by global norm and by value, accumulation."""
    _, tmp, runs = pipelined
    assert_matches_single_device(tmp, runs[name])


def test_bf16_mixed_losses_match_single_device(pipelined):
    _, tmp, runs = pipelined
    _, _, expected = reference(runs["bf16"])
    for result in rank_results(tmp / "bf16"):
        assert result["train_losses"] == pytest.approx(expected["train_losses"], rel=1e-2)


def test_fp16_overflow_on_one_stage_skips_the_step_on_every_stage(pipelined):
    """An inf in one stage's gradients: every stage skips that step and halves its scale, as one device does."""
    _, tmp, runs = pipelined
    run = runs["fp16_overflow"]
    initial, expected, expected_metrics = reference(run)
    assert expected_metrics["grad_scale"] == 2.0**15  # one skipped step halved the initial 2**16
    for result in rank_results(tmp / run["name"]):
        assert result["grad_scale"] == expected_metrics["grad_scale"]
    assert relative_weight_error(initial, expected, merged_state_dict(tmp / run["name"])) < 1e-2


def running_statistics(state: dict) -> dict:
    return {k: v.double() for k, v in state.items() if "running" in k or "num_batches" in k}


def test_recomputation_does_not_update_batch_norm_statistics_twice(pipelined):
    _, tmp, _ = pipelined
    always, never = merged_state_dict(tmp / "bn_always"), merged_state_dict(tmp / "bn_never")
    assert running_statistics(always)
    for key, value in always.items():
        torch.testing.assert_close(value, never[key], rtol=1e-5, atol=1e-6, msg=key)


def test_deferred_batch_norm_statistics_equal_single_device(pipelined):
    _, tmp, runs = pipelined
    _, expected, _ = reference(runs["bn_deferred"])
    expected = running_statistics(expected)
    for key, value in running_statistics(merged_state_dict(tmp / "bn_deferred")).items():
        torch.testing.assert_close(value, expected[key], rtol=1e-5, atol=1e-6, msg=key)
    # Negative control: per-micro-batch statistics (the default) do differ from one device's.
    default = running_statistics(merged_state_dict(tmp / "bn_per_micro_batch"))
    assert any(not torch.allclose(default[k], expected[k], rtol=1e-3) for k in expected if "running_var" in k)


def test_every_stage_reads_the_same_shuffled_batches(pipelined):
    """Each stage's dropout draws its own randomness; the sampler's shuffle must agree on every stage anyway."""
    _, tmp, _ = pipelined
    results = rank_results(tmp / "shuffled_dropout")
    assert len(results[0]["batches"]) == 9  # 3 epochs of 3 batches
    assert results[0]["batches"][:3] != results[0]["batches"][3:6]  # the data really is reshuffled each epoch
    for result in results[1:]:
        assert result["batches"] == results[0]["batches"]


def test_a_second_schedule_runs_unchanged_and_matches_single_device(pipelined):
    """The engine executes the schedule's actions: a schedule with the backwards in forward order is one function."""
    _, tmp, runs = pipelined
    backwards = [(a.kind, a.micro_batch) for a in backwards_in_forward_order(1, 3, 2, 1)][6:]
    assert backwards == [("recv_grad", 0), ("backward", 0), ("send_grad", 0), ("recv_grad", 1), ("backward", 1),
                         ("send_grad", 1)]
    assert_matches_single_device(tmp, runs["backwards_in_forward_order"])


def test_comparison_detects_a_dropped_micro_batch_gradient(pipelined):
    _, tmp, runs = pipelined
    run = runs["dropped"]
    initial, expected, _ = reference(run)
    error = relative_weight_error(initial, expected, merged_state_dict(tmp / run["name"]))
    assert error > 100 * TOLERANCE, f"dropping a micro-batch's gradient changed the weights by only {error:.2e}"


# ---- Dropout: as on one device, statistically -----------------------------------------------------------------------
# TwoDropoutsClassifier pipelines Linear, Dropout(0.5), Linear, Dropout(0.5): the dropout layers are on stages 0 and 1
# of 2, or 1 and 3 of 4, and see inputs of the same shape.


def dropout_masks(run_dir) -> dict[str, torch.Tensor]:
    """Each dropout layer's masks (recorded on the rank that holds it), ``[step, call, *micro-batch shape]``: the
    calls of a step are its forwards in micro-batch order, then any re-computations."""
    masks: dict[str, list[torch.Tensor]] = {}
    for path in sorted(run_dir.glob("masks*.pt")):
        masks.update(torch.load(path))
    assert sorted(masks) == ["net.model.1", "net.model.3"]
    return {name: torch.stack(calls).unflatten(0, (DROPOUT_STEPS, -1)) for name, calls in masks.items()}


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """The fraction of elements two masks agree on: 1/2 for independent masks that keep half, 1 for equal ones."""
    return float((a == b).float().mean())


def test_dropout_layers_on_different_stages_draw_different_masks(pipelined):
    """Every stage starts a step from the same random state; drawn from it, both layers would drop the same
    elements at every step."""
    _, tmp, _ = pipelined
    masks = dropout_masks(tmp / "dropout")
    first, second = masks["net.model.1"], masks["net.model.3"]
    assert first.shape == second.shape == (DROPOUT_STEPS, DROPOUT_MICRO_BATCHES, 4, 16)
    equal_steps = [step for step in range(DROPOUT_STEPS) if torch.equal(first[step], second[step])]
    assert equal_steps == [], f"the two dropout layers drew the same masks at steps {equal_steps}"
    assert 0.45 < agreement(first, second) < 0.55  # measured: 0.498 on 2 stages


def test_dropout_masks_of_different_micro_batches_differ(pipelined):
    _, tmp, _ = pipelined
    for name, masks in dropout_masks(tmp / "dropout").items():
        for step in range(DROPOUT_STEPS):
            for a, b in itertools.combinations(range(DROPOUT_MICRO_BATCHES), 2):
                assert not torch.equal(masks[step, a], masks[step, b]), (name, step, a, b)
        assert 0.45 < agreement(masks[:, 0], masks[:, 1]) < 0.55, name


def test_dropout_keeps_half_of_the_elements(pipelined):
    """Dropout(0.5): 3840 elements per layer, so the kept fraction is 0.5 to within 0.008 (one standard deviation)."""
    _, tmp, _ = pipelined
    for name, masks in dropout_masks(tmp / "dropout").items():
        assert 0.47 < float(masks.float().mean()) < 0.53, name


def test_dropout_masks_and_losses_are_reproducible(pipelined):
    """The same seed, stage count and micro-batch count: the same masks, losses and weights."""
    _, tmp, _ = pipelined
    first, again = dropout_masks(tmp / "dropout"), dropout_masks(tmp / "dropout_again")
    for name in first:
        assert torch.equal(first[name], again[name]), name
    for result, result_again in zip(rank_results(tmp / "dropout"), rank_results(tmp / "dropout_again"), strict=True):
        assert result["train_losses"] == result_again["train_losses"]
    weights, weights_again = merged_state_dict(tmp / "dropout"), merged_state_dict(tmp / "dropout_again")
    assert all(torch.equal(weights[key], weights_again[key]) for key in weights)


def test_recomputation_draws_the_forward_masks(pipelined):
    """checkpoint="always" re-computes every forward in backward: with the same masks, so with the same losses as
    checkpoint="never"."""
    _, tmp, _ = pipelined
    kept, recomputed = dropout_masks(tmp / "dropout"), dropout_masks(tmp / "dropout_recomputed")
    for name, masks in recomputed.items():
        forwards, recomputations = masks.split(DROPOUT_MICRO_BATCHES, dim=1)
        assert torch.equal(forwards, kept[name]), name
        assert torch.equal(recomputations.flip(1), forwards), name  # re-computed in reverse micro-batch order
    for result, result_recomputed in zip(rank_results(tmp / "dropout"), rank_results(tmp / "dropout_recomputed"), strict=True):
        assert result["train_losses"] == result_recomputed["train_losses"]


def test_training_with_dropout_reaches_the_validation_loss_of_one_device(pipelined):
    """The masks differ from one device's, so the losses do too, step by step; where training ends does not. Loose:
    one device's validation loss after these 15 steps is 0.683, 2 stages' is 0.631."""
    _, tmp, runs = pipelined
    _, _, expected = reference(runs["dropout"])
    for result in rank_results(tmp / "dropout"):
        assert result["final_metrics"]["val_loss"] == pytest.approx(expected["final_metrics"]["val_loss"], rel=0.2)
