"""Every GPipeStrategy setting is checked once, with one message naming the setting, the value and the fix: in Python
(``GPipeStrategy(...)``) and under Hydra, where the message names the config key (``strategy.num_stages=0 ...``)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from omegaconf import OmegaConf
from torch import nn

from lightning_pipe import GPipeStrategy, PipelineParallelConfig, PretrainedWeights
from lightning_pipe.integration.hydra_schema import validate_strategy_config
from lightning_pipe.partition.balance import profiling_sample
from lightning_pipe.reliability.stall_rule import StallRule
from lightning_pipe.schedules.builtin import SCHEDULES, gpipe
from lightning_pipe.settings import PipelineSettings, check_process_count

# (settings, the message's start; "{key}" is "" in Python and "strategy." under Hydra)
INVALID = {
    "num_stages": ({"num_stages": 0}, "{key}num_stages=0 is invalid; it must be a positive integer (1 or more)."),
    "num_micro_batches": (
        {"num_micro_batches": -1}, "{key}num_micro_batches=-1 is invalid; it must be a positive integer (1 or more)."
    ),
    "checkpoint": (
        {"checkpoint": "sometimes"},
        "{key}checkpoint='sometimes' is not a checkpoint mode; use one of 'always', 'except_last', 'never'",
    ),
    "balance mode": (
        {"balance": "fastest"},
        "{key}balance='fastest' is not a balancing mode; use one of 'uniform', 'parameters', 'time', 'memory'",
    ),
    "balance type": ({"balance": 7}, "{key}balance=7 is invalid; give one block count per stage as a list"),
    "balance entries": (
        {"balance": [3, 0]}, "{key}balance=[3, 0] is invalid; block counts must be positive integers"
    ),
    "balance length": (
        {"num_stages": 2, "balance": [4, 2, 2]},
        "{key}balance=[4, 2, 2] has 3 entries but {key}num_stages=2; give one block count per stage.",
    ),
    "balance length with chunks": (
        {"num_stages": 2, "schedule": "interleaved_1f1b", "balance": [4, 4]},
        "{key}balance=[4, 4] has 2 entries but {key}schedule='interleaved_1f1b' cuts the pipelined blocks into"
        " {key}num_stages * {key}virtual_stages = 2 * 2 = 4 model chunks; give one block count per chunk, in model"
        " order (e.g. {key}balance=[2, 2, 2, 2]).",
    ),
    "module_name": (
        {"module_name": 3},
        "{key}module_name=3 is invalid; give the dotted path of the nn.Sequential or nn.ModuleList to pipeline",
    ),
    "module_name entries": (
        {"module_name": ["model.conv1", 2]}, "{key}module_name=['model.conv1', 2] is invalid; give the dotted path"
    ),
    "trace_steps type": (
        {"trace_steps": 5}, "{key}trace_steps=5 is invalid; give the training steps to trace as a list"
    ),
    "trace_steps entries": ({"trace_steps": [3, -1]}, "{key}trace_steps=[3, -1] is invalid"),
    "trace_dir": ({"trace_dir": 3}, "{key}trace_dir=3 is invalid; give a directory path"),
    "mesh_order": (
        {"mesh_order": ["pp", "pp"]}, "{key}mesh_order=['pp', 'pp'] is invalid; use ['pp', 'dp'] (pipeline outermost"
    ),
    "start_method": (
        {"start_method": "thread"},
        "{key}start_method='thread' is not a start method; use one of 'popen', 'spawn', 'fork', 'forkserver'",
    ),
    "log_bubble_fraction": (
        {"log_bubble_fraction": "yes"}, "{key}log_bubble_fraction='yes' is invalid; use True or False."
    ),
    "deferred_batch_norm": ({"deferred_batch_norm": 1}, "{key}deferred_batch_norm=1 is invalid; use True or False."),
    "save_distributed_checkpoint": (
        {"save_distributed_checkpoint": "yes"},
        "{key}save_distributed_checkpoint='yes' is invalid; use True, False or None (the default).",
    ),
    "gather_model_after_run": (
        {"gather_model_after_run": None}, "{key}gather_model_after_run=None is invalid; use True or False."
    ),
    "schedule": (
        {"schedule": "2f2b"},
        "{key}schedule='2f2b' is not a schedule; use one of 'gpipe', '1f1b', 'interleaved_1f1b', 'zero_bubble', 'zbv',"
        " 'auto' or a function (stage, num_stages, num_micro_batches, virtual_stages) -> list[Action]",
    ),
    "virtual_stages": (
        {"virtual_stages": 2},
        "{key}virtual_stages=2 is invalid for {key}schedule='gpipe', which runs exactly 1 model chunk per stage; leave"
        " {key}virtual_stages unset (the default is 1), or use {key}schedule='interleaved_1f1b' for several chunks",
    ),
    "virtual_stages of a V": (
        {"schedule": "zbv", "virtual_stages": 3},
        "{key}virtual_stages=3 is invalid for {key}schedule='zbv', which runs exactly 2 model chunks per stage;",
    ),
    "virtual_stages of interleaved": (
        {"schedule": "interleaved_1f1b", "virtual_stages": 1},
        "{key}virtual_stages=1 is invalid for {key}schedule='interleaved_1f1b', which runs 2 or more model chunks",
    ),
    "compile type": (
        {"compile": "yes"},
        "{key}compile='yes' is invalid; use True, False or a mapping of torch.compile's keyword arguments",
    ),
    "compile arguments": (
        {"compile": {"mdoe": "max-autotune"}},
        "{key}compile={{'mdoe': 'max-autotune'}} is invalid; 'mdoe' is not a keyword argument of torch.compile,",
    ),
    "pretrained type": (
        {"pretrained": 3}, "{key}pretrained=3 is invalid; give the path of a model directory or weights file"
    ),
    "pretrained path": (
        {"pretrained": "/no/such/model"},
        "{key}pretrained: '/no/such/model' does not exist; give a model directory or a weights file.",
    ),
    "pretrained directory": (
        {"pretrained": str(Path(__file__).parent)},
        "{key}pretrained: " + repr(str(Path(__file__).parent)) + " holds no weights this package reads: no"
        " model.safetensors.index.json, model.safetensors, pytorch_model.bin.index.json or pytorch_model.bin",
    ),
    "pretrained mapping": (
        {"pretrained": {"path": "/models/gpt2", "dtyp": "checkpoint"}},
        "{key}pretrained={{'path': '/models/gpt2', 'dtyp': 'checkpoint'}} is invalid; give a path, or a mapping with"
        " 'path'",
    ),
    "pretrained dtype": (
        {"pretrained": {"path": str(Path(__file__)), "dtype": "fp8"}},
        "{key}pretrained.dtype='fp8' is invalid; use 'precision' (the Trainer precision's dtype) or 'checkpoint'",
    ),
    "stall_watchdog": ({"stall_watchdog": "on"}, "{key}stall_watchdog='on' is invalid; use True or False."),
    "stall_multiple": (
        {"stall_multiple": 0.5},
        "{key}stall_multiple=0.5 is invalid; a wait may last this many times the slowest recent training step, so give"
        " a number of at least 1 (default 10), or turn the watchdog off with {key}stall_watchdog=False.",
    ),
    "stall_floor": (
        {"stall_floor": 0},
        "{key}stall_floor=0 is invalid; give the shortest bound on a wait in seconds, a positive number (default 30)",
    ),
    "stall_first_step": (
        {"stall_first_step": -1},
        "{key}stall_first_step=-1 is invalid; give the bound on a wait in a first step (a run's first, an epoch's"
        " first, the first after validation or a checkpoint, which may compile or allocate for long) in seconds, a"
        " positive number or a timedelta, or None (the default: derived from what the set-up measured",
    ),
}


@pytest.mark.parametrize("case", INVALID.values(), ids=INVALID.keys())
def test_invalid_setting_fails_in_python_naming_the_setting(case):
    settings, message = case
    with pytest.raises(ValueError) as error:
        GPipeStrategy(**settings)
    assert str(error.value).startswith(message.format(key=""))


@pytest.mark.parametrize("case", INVALID.values(), ids=INVALID.keys())
def test_invalid_setting_fails_under_hydra_naming_the_key(case):
    settings, message = case
    node = OmegaConf.create({"num_stages": 2, **settings})
    with pytest.raises(ValueError) as error:
        validate_strategy_config(node, key="strategy")
    assert str(error.value).startswith(message.format(key="strategy."))


def test_process_count_that_is_no_multiple_of_the_stages_names_the_counts():
    with pytest.raises(ValueError) as error:
        check_process_count(2, devices=3, num_nodes=1)
    assert str(error.value).startswith(
        "devices=3 on num_nodes=1 starts 3 processes, not a multiple of num_stages=2: GPipe needs devices * num_nodes"
    )
    with pytest.raises(ValueError) as error:
        check_process_count(4, devices=2, num_nodes=3, key="strategy.", trainer_key="trainer.")
    assert str(error.value).startswith("trainer.devices=2 on trainer.num_nodes=3 starts 6 processes, not a multiple of")
    assert "set trainer.devices to 4 for one pipeline" in str(error.value)
    check_process_count(2, devices=2, num_nodes=2)  # two replicas of a 2-stage pipeline


def test_balance_length_is_checked_against_the_stage_count_resolved_from_the_devices():
    strategy = GPipeStrategy(balance=[1, 2, 3])  # no num_stages: one stage per process, known at launch
    with pytest.raises(ValueError, match=r"^balance=\[1, 2, 3\] has 3 entries but there are 2 stages"):
        Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)
    strategy = GPipeStrategy(balance=[4, 4], schedule="zbv")  # 2 chunks per stage: one count per chunk
    with pytest.raises(ValueError, match=r"^balance=\[4, 4\] has 2 entries but schedule='zbv' cuts .* = 4 model chunks"):
        Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)
    GPipeStrategy(num_stages=2, schedule="interleaved_1f1b", balance=[1, 3, 2, 2])


def forward_before_its_receive(stage: int, num_stages: int, num_micro_batches: int, virtual_stages: int) -> list:
    """GPipe, with the second stage computing micro-batch 0 before receiving it: a user's broken schedule."""
    actions = gpipe(stage, num_stages, num_micro_batches, virtual_stages)
    return [actions[1], actions[0], *actions[2:]] if stage == 1 else actions


def test_a_users_schedule_is_run_through_the_checker_before_any_process_starts():
    message = (
        r"^schedule 'forward_before_its_receive' with 2 stages, 1 micro-batch and 1 chunk per stage: stage 1's"
        r" action 0, forward\(chunk 1, micro-batch 0\), runs before its receive, which provides its input"
    )
    with pytest.raises(ValueError, match=message):
        GPipeStrategy(num_stages=2, schedule=forward_before_its_receive)
    strategy = GPipeStrategy(schedule=forward_before_its_receive)  # no num_stages: checked when the count is known
    with pytest.raises(ValueError, match=message):
        Trainer(strategy=strategy, accelerator="cpu", devices=2, logger=False)


def test_schedule_settings_resolve_to_a_schedule_and_its_chunks_per_stage():
    assert PipelineSettings(schedule="interleaved_1f1b").virtual_stages == 2
    assert PipelineSettings(schedule="interleaved_1f1b", virtual_stages=3).virtual_stages == 3
    settings = PipelineSettings(num_stages=3, schedule=lambda *counts: SCHEDULES["1f1b"].actions(*counts))
    assert settings.schedule.per_micro_batch and settings.virtual_stages == 1
    interleaved = lambda *counts: SCHEDULES["interleaved_1f1b"].actions(*counts)  # noqa: E731
    settings = PipelineSettings(num_stages=2, schedule=interleaved, virtual_stages=3)  # checked with 3 chunks
    assert settings.schedule.per_micro_batch and settings.virtual_stages == 3 and settings.schedule.placement == "loop"
    assert PipelineSettings(schedule="zbv").schedule is SCHEDULES["zbv"]
    node = OmegaConf.create({"num_stages": 2, "schedule": "interleaved_1f1b", "virtual_stages": 4})
    assert PipelineSettings.from_options(node, key="strategy.").virtual_stages == 4


def test_counts_default_to_a_stage_per_process_and_four_micro_batches_per_stage():
    assert PipelineSettings().pipeline_config(num_processes=3) == PipelineParallelConfig(3, 12)
    assert PipelineSettings(num_stages=2).pipeline_config(num_processes=4) == PipelineParallelConfig(2, 8)
    assert PipelineSettings(num_micro_batches=5).pipeline_config(num_processes=2) == PipelineParallelConfig(2, 5)
    node = OmegaConf.create({"num_stages": 3, "num_micro_batches": None})
    assert validate_strategy_config(node) == PipelineParallelConfig(3, 12)


def test_valid_settings_are_kept_in_one_form():
    settings = PipelineSettings(
        balance=(3, 5), trace_steps=range(2), trace_dir="traces", mesh_order=["dp", "pp"], recompute="never"
    )
    assert settings.balance == [3, 5] and settings.trace_steps == (0, 1) and settings.trace_dir == Path("traces")
    assert settings.mesh_order == ("dp", "pp") and settings.recompute == "never"
    node = OmegaConf.create({"num_stages": 2, "checkpoint": "always", "balance": [1, 3], "mesh_order": ["pp", "dp"]})
    from_hydra = PipelineSettings.from_options(node, key="strategy.")
    assert from_hydra.recompute == "always" and from_hydra.balance == [1, 3] and type(from_hydra.balance) is list


def test_stall_settings_become_the_watchdog_rule_or_none_when_off():
    # No stall_first_step: the first steps' bound is derived from what the set-up measured (see test_stall_watchdog.py).
    assert PipelineSettings().stall_rule == StallRule(multiple=10.0, floor_s=30.0, first_step_s=None)
    assert PipelineSettings(
        stall_floor=timedelta(minutes=2), stall_multiple=4, stall_first_step=timedelta(minutes=20)
    ).stall_rule == StallRule(4.0, 120.0, 1200.0)
    assert PipelineSettings(stall_watchdog=False).stall_rule is None
    node = OmegaConf.create({"num_stages": 2, "stall_floor": 5, "stall_multiple": 20, "stall_first_step": 60})
    assert PipelineSettings.from_options(node, key="strategy.").stall_rule == StallRule(20.0, 5.0, 60.0)


def test_compile_setting_becomes_torch_compile_arguments_or_none():
    assert PipelineSettings().compile_options is None
    assert PipelineSettings(compile=True).compile_options == {}
    node = OmegaConf.create({"num_stages": 2, "compile": {"backend": "aot_eager", "options": {"trace.enabled": True}}})
    from_hydra = PipelineSettings.from_options(node, key="strategy.")
    assert from_hydra.compile_options == {"backend": "aot_eager", "options": {"trace.enabled": True}}
    assert type(from_hydra.compile_options["options"]) is dict  # torch.compile gets plain dicts, not OmegaConf nodes


def test_module_name_is_a_path_or_a_list_of_sibling_modules_kept_as_a_tuple():
    assert PipelineSettings(module_name="net.layers").module_name == "net.layers"
    assert PipelineSettings(module_name=["m.conv1", "m.layer1"]).module_name == ("m.conv1", "m.layer1")
    node = OmegaConf.create({"num_stages": 2, "module_name": ["m.conv1", "m.layer1", "m.fc"]})
    assert PipelineSettings.from_options(node, key="strategy.").module_name == ("m.conv1", "m.layer1", "m.fc")


def test_pretrained_setting_is_a_path_a_mapping_or_pretrained_weights_kept_as_pretrained_weights(tmp_path):
    (tmp_path / "model.safetensors").touch()  # the check lists the directory; it reads no weights
    assert PipelineSettings(pretrained=str(tmp_path)).pretrained == PretrainedWeights(tmp_path, None, "precision")
    node = OmegaConf.create({"num_stages": 2, "pretrained": {"path": str(tmp_path), "prefix": "model",
                                                             "dtype": "checkpoint"}})
    from_hydra = PipelineSettings.from_options(node, key="strategy.").pretrained
    assert from_hydra == PretrainedWeights(tmp_path, "model.", "checkpoint")  # the prefix ends with its dot
    assert PipelineSettings(pretrained=from_hydra).pretrained == from_hydra


def test_a_config_or_mapping_passed_as_num_stages_holds_both_counts():
    assert PipelineSettings(PipelineParallelConfig(3, 6)).pipeline_config(1) == PipelineParallelConfig(3, 6)
    with pytest.raises(ValueError, match="unknown pipeline config keys \\['chunks'\\]"):
        PipelineSettings({"num_stages": 2, "chunks": 4})
    with pytest.raises(ValueError, match="pass num_micro_batches inside the config"):
        PipelineSettings(PipelineParallelConfig(3, 6), num_micro_batches=4)


def test_profiled_balance_takes_the_sample_or_the_example_input_and_names_the_fix_without_either():
    model, sample, example = nn.Linear(2, 2), torch.ones(1, 2), torch.zeros(1, 2)
    assert profiling_sample("time", sample, model) is sample
    model.example_input_array = example
    assert profiling_sample("memory", None, model) is example
    assert profiling_sample("parameters", None, nn.Linear(2, 2)) is None  # needs no sample
    with pytest.raises(ValueError, match=r"^balance='time' profiles every block on a sample input, but there is none.*sample=<one batch>"):
        profiling_sample("time", None, nn.Linear(2, 2))
