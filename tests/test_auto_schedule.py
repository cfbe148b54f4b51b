"""``schedule="auto"`` and ``python -m lightning_pipe.plan``: the ranking is right, the choice is made once and taken
by every rank, fits the memory budget, trains as one device, is configurable from Hydra, and is refused, with the
fix, for a module whose results it would change."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from helpers.compare import merged_state_dict, rank_results, relative_weight_error, single_device_run
from helpers.launch import launch
from helpers.models import MODELS
from lightning_pipe.auto_schedule import candidates_for, check_module_takes_auto, plan_schedule, settled
from lightning_pipe.integration.hydra_schema import validate_config
from lightning_pipe.schedules.choice import (
    AUTO_SCHEDULES, BlockCosts, Configuration, CostModel, choose, configurations, plan_table, rank_configurations,
)
from lightning_pipe.commands.plan import main as plan_command
from lightning_pipe.settings import PipelineSettings
from test_hydra_config import composed

REPO = Path(__file__).resolve().parents[1]
BLOCK = BlockCosts(samples=4, forward=0.004, input_gradient=0.004, weight_gradient=0.004, activation_bytes=4e6,
                   input_bytes=1e6, parameter_bytes=1e6)


def proportional(blocks: int = 8) -> CostModel:
    """Costs proportional to the micro-batch: every configuration does the same work, the bubble decides."""
    return CostModel.measured([BLOCK] * blocks, [BLOCK.scaled(16)] * blocks)


# ---- the pure ranking -----------------------------------------------------------------------------------------


def test_the_ranking_is_by_predicted_step_and_a_smaller_bubble_wins_at_equal_work():
    rows = rank_configurations(proportional(), num_stages=4, batch_size=32)
    assert [round(r.step, 9) for r in rows] == sorted(round(r.step, 9) for r in rows)
    never = {(r.configuration.schedule, r.configuration.num_micro_batches): r for r in rows
             if r.configuration.recompute == "never" and r.configuration.virtual_stages <= 2}
    # Equal work per step: GPipe and 1F1B tie, zero bubble beats them, ZB-V beats zero bubble, as their bubbles say.
    assert never["gpipe", 8].step == pytest.approx(never["1f1b", 8].step)
    assert never["zbv", 8].step < never["zero_bubble", 8].step < never["1f1b", 8].step
    # 1F1B holds S - stage micro-batches, GPipe all M.
    assert never["1f1b", 8].peak_activation_bytes[0] == pytest.approx(never["gpipe", 8].peak_activation_bytes[0] / 2)
    # Re-computation costs a forward per micro-batch and keeps only inputs.
    recomputed = next(r for r in rows if r.configuration == Configuration("gpipe", 8, 1, "always"))
    assert recomputed.step > never["gpipe", 8].step and recomputed.memory_bytes < never["gpipe", 8].memory_bytes


def test_a_fixed_cost_per_call_makes_more_micro_batches_slower():
    """The cost model is the line through the two profiled sizes: a block whose time does not shrink with the
    micro-batch makes many small micro-batches cost more than the smaller bubble saves."""
    fixed = CostModel.measured([BLOCK] * 8, [dataclasses.replace(BLOCK, samples=16)] * 8)
    rows = rank_configurations(fixed, 4, 32, candidates=configurations(4, 32, 8, ("1f1b",), recompute=("never",)))
    assert [r.configuration.num_micro_batches for r in rows] == [4, 8, 16]


def test_the_choice_is_the_fastest_that_fits_the_budget_and_none_fitting_is_refused():
    rows = rank_configurations(proportional(), 4, 32)
    fastest = rows[0]
    budget = fastest.memory_bytes - 1  # excludes the fastest
    limited = rank_configurations(proportional(), 4, 32, memory_budget=budget)
    chosen = choose(limited)
    assert chosen.configuration != fastest.configuration and chosen.memory_bytes <= budget
    assert all(r.step >= chosen.step or not r.fits for r in limited)
    assert "*" in plan_table(limited)  # the excluded ones are marked
    with pytest.raises(ValueError, match="no schedule fits the memory budget: the least memory"):
        choose(rank_configurations(proportional(), 4, 32, memory_budget=1))


def test_candidates_keep_what_the_user_set_and_auto_leaves_zbv_out():
    open_ = candidates_for(PipelineSettings(schedule="auto"), 2, 16, 8)
    assert {c.schedule for c in open_} == set(AUTO_SCHEDULES)
    assert {c.num_micro_batches for c in open_} == {2, 4, 8}
    fixed = candidates_for(PipelineSettings(schedule="auto", num_micro_batches=4, recompute="never",
                                            balance=[4, 4]), 2, 16, 8)
    assert {(c.num_micro_batches, c.recompute, c.virtual_stages) for c in fixed} == {(4, "never", 1)}
    chosen = settled(PipelineSettings(schedule="auto", memory_budget="1GB"), Configuration("zero_bubble", 8, 1, "never"))
    assert (chosen.schedule.name, chosen.num_micro_batches, chosen.recompute, chosen.is_auto) == (
        "zero_bubble", 8, "never", False)


# ---- refusals and Hydra -----------------------------------------------------------------------------------------


def test_a_module_whose_results_auto_would_change_is_refused_naming_the_fix():
    module = MODELS["batchnorm_before"]()
    with pytest.raises(ValueError, match=r"BatchNorm outside them \('norm'\).*schedule='gpipe' keeps them"):
        check_module_takes_auto(module, module.net.model, PipelineSettings(schedule="auto"))
    inside = MODELS["batchnorm"]()
    with pytest.raises(ValueError, match="chooses the micro-batch count.*set num_micro_batches"):
        check_module_takes_auto(inside, inside.net.model, PipelineSettings(schedule="auto"))
    check_module_takes_auto(inside, inside.net.model, PipelineSettings(schedule="auto", num_micro_batches=4))
    with pytest.raises(ValueError, match="memory_budget='1GB' is set but schedule is not 'auto'"):
        PipelineSettings(memory_budget="1GB")


def test_auto_with_no_sample_and_no_training_batch_names_the_fix():
    """Outside a fit (here: no trainer) there is no first training batch to profile on either."""
    model = MODELS["emulated"]()
    with pytest.raises(ValueError, match=r"^schedule='auto' profiles every block on a sample input, but there is none"
                                         r".*example_input_array.*GPipeStrategy\(sample=\.\.\.\)"):
        plan_schedule(model, model.net.model, PipelineSettings(schedule="auto"), 2, 16, torch.device("cpu"), None)


def test_hydra_strategy_schedule_auto_configures_the_strategy():
    cfg = composed("strategy.schedule=auto", "strategy.memory_budget=512MiB")
    validate_config(cfg)
    strategy = instantiate(cfg.strategy, _convert_="all")
    assert strategy._settings.is_auto and strategy._settings.memory_budget == 512 * 2**20
    assert strategy.layout.loss_stage == 1  # the layout every schedule auto may choose keeps
    with pytest.raises(ValueError, match="strategy.memory_budget='lots' is invalid"):
        validate_config(composed("strategy.schedule=auto", "strategy.memory_budget=lots"))


# ---- the strategy, on 2 processes -------------------------------------------------------------------------------

AUTO = {"model": "auto_emulated", "num_micro_batches": None, "checkpoint": None, "strategy": {"schedule": "auto"}}
RUNS = [
    {**AUTO, "name": "auto"}, {**AUTO, "name": "auto_budget", "memory_budget_below_fastest": True},
    # No example_input_array: the blocks profiled on the first training batch, for the choice and the split.
    {**AUTO, "name": "auto_on_the_batch", "model": "emulated", "strategy": {"schedule": "auto", "balance": "time"}},
]


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("auto")
    launch("fits_worker.py", {"devices": 2, "out": str(tmp), "runs": RUNS}, tmp, timeout=600)
    return tmp


def test_auto_chooses_once_and_every_rank_runs_the_choice(fitted):
    choices = [result["choice"] for result in rank_results(fitted / "auto")]
    assert len(choices) == 2 and choices[0] == choices[1]
    choice = choices[0]
    assert choice["schedule"] in AUTO_SCHEDULES and choice["num_micro_batches"] in (2, 4, 8)
    assert choice["chosen"].startswith(choice["schedule"]) and "Schedule chosen for 2 stages" in choice["message"]
    assert "peak activations per stage" in choice["message"]


def test_a_budget_that_excludes_the_fastest_gives_a_choice_that_fits(fitted):
    """The budget is just below what the fastest configuration needs, in the profile the choice is made from (the
    worker ranks that one profile without a budget, then with it): the choice is another configuration, within the
    budget, and the message says that faster ones exceed it."""
    results = rank_results(fitted / "auto_budget")
    limited = results[0]["choice"]  # global rank 0, which chose
    budget = limited["memory_budget"]
    assert budget < limited["fastest_memory_bytes"]
    assert limited["chosen"] != limited["fastest"] and limited["memory_bytes"] <= budget
    assert "exceed the memory budget" in limited["message"]
    assert all(result["choice"]["chosen"] == limited["chosen"] for result in results)  # every rank runs it


def test_without_an_example_input_auto_profiles_on_the_first_training_batch_and_every_rank_takes_its_choice(fitted):
    """``schedule="auto"`` and ``balance="time"``: global rank 0 profiles the blocks through the training step on the
    first training batch; every rank runs the same configuration and the same split."""
    results = rank_results(fitted / "auto_on_the_batch")
    assert len(results) == 2 and results[0]["choice"] == results[1]["choice"]
    assert results[0]["chunk_ranges"] == results[1]["chunk_ranges"]
    choice = results[0]["choice"]
    assert choice["schedule"] in AUTO_SCHEDULES and ", on the first training batch;" in choice["message"]


@pytest.mark.parametrize("name", ["auto", "auto_budget", "auto_on_the_batch"])
def test_auto_trains_as_one_device_on_the_whole_batch(fitted, name):
    run = next(r for r in RUNS if r["name"] == name)
    initial, expected, _ = single_device_run(run)
    assert relative_weight_error(initial, expected, merged_state_dict(fitted / name)) < 1e-5
    # Negative control: the comparison sees a change of the weights the size of a tenth of training's.
    moved = {k: v + 0.1 * (expected[k] - initial[k]) if v.is_floating_point() else v for k, v in expected.items()}
    assert relative_weight_error(initial, expected, moved) > 1e-5


# ---- the command ------------------------------------------------------------------------------------------------


def test_plan_command_ranks_the_example_model_from_a_costs_file(tmp_path, capsys):
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"batch_size": 32, "small": [
        {**dataclasses.asdict(BLOCK)} for _ in range(8)], "large": [dataclasses.asdict(BLOCK.scaled(16))] * 8,
        "runtime": {"action_time": 0.0, "send_time": 0.0}}))  # the runtime free: the ideal steps
    result = subprocess.run(
        [sys.executable, "-m", "lightning_pipe.plan", "--costs", str(costs), "--stages", "4"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Recommended: zbv (M=16" in result.stdout and "peak activations per stage" in result.stdout
    # The runtime's own cost per action, as measured on a machine, makes the 3·M actions of 16 micro-batches dear.
    plan_command(["--costs", str(costs), "--stages", "4", "--action-time", "5"])
    costly = capsys.readouterr().out
    assert "runtime: 5.00 ms per action, 0.00 ms per message" in costly
    assert "Recommended: zero_bubble (M=4" in costly
