"""The Hydra config tree composes, builds the strategy it describes, and rejects bad values by naming their key."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from hydra.errors import ConfigCompositionException
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import OmegaConf

import lightning_pipe
from lightning_pipe import PipelineParallelConfig
from lightning_pipe.integration.hydra_schema import start_method_for_this_run, validate_config
from lightning_pipe.schedules.builtin import SCHEDULES

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = ("model", "data", "trainer", "strategy")


def composed(*overrides: str, hydra_config: bool = False):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=hydra_config)


def every_option() -> list[str]:
    """``group=option`` for every file of every group, so that a new option is tested the day it is added."""
    return [f"{group}={path.stem}" for group in GROUPS for path in sorted((CONF / group).glob("*.yaml"))]


@pytest.mark.parametrize("option", every_option())
def test_every_config_option_composes_and_validates(option):
    cfg = composed(option)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert set(GROUPS) <= resolved.keys()
    assert validate_config(cfg) == PipelineParallelConfig(num_stages=2, num_micro_batches=8)
    assert resolved["trainer"]["devices"] == resolved["strategy"]["num_stages"] == 2


def test_gpu_trainer_differs_from_cpu_only_in_accelerator():
    cpu = OmegaConf.to_container(composed("trainer=cpu").trainer, resolve=True)
    gpu = OmegaConf.to_container(composed("trainer=gpu").trainer, resolve=True)
    assert gpu.pop("accelerator") == "gpu" and cpu.pop("accelerator") == "cpu"
    assert gpu == cpu


@pytest.mark.parametrize("num_stages", [1, 4])
def test_trainer_devices_follow_the_stage_count(num_stages):
    cfg = composed(f"strategy.num_stages={num_stages}")
    assert cfg.trainer.devices == num_stages
    assert validate_config(cfg).num_micro_batches == 4 * num_stages


def test_devices_may_be_a_multiple_of_the_stages_for_data_parallel_replicas():
    cfg = composed("strategy.num_stages=2", "trainer.devices=4")
    assert validate_config(cfg) == PipelineParallelConfig(num_stages=2, num_micro_batches=8)


def test_strategy_config_instantiates_the_strategy_it_describes():
    cfg = composed("strategy.num_stages=4", "strategy.num_micro_batches=6", "strategy.balance=[2,2,2,2]")
    strategy = instantiate(cfg.strategy, _convert_="all")
    assert isinstance(strategy, lightning_pipe.GPipeStrategy)
    assert strategy.config == PipelineParallelConfig(num_stages=4, num_micro_batches=6)
    assert strategy._settings.balance == [2, 2, 2, 2] and strategy._settings.start_method == "popen"


@pytest.mark.parametrize("balance", ["uniform", "parameters", "time", "memory", "[3,5]", "null"])
def test_every_balance_form_passes_validation(balance):
    cfg = composed(f"strategy.balance={balance}")
    validate_config(cfg)
    assert instantiate(cfg.strategy, _convert_="all")._settings.balance == OmegaConf.to_container(cfg.strategy)["balance"]


def test_a_projects_own_config_node_configures_the_strategy():
    node = OmegaConf.create({"num_stages": 3, "num_micro_batches": 5})
    assert lightning_pipe.GPipeStrategy(node).config == PipelineParallelConfig(num_stages=3, num_micro_batches=5)


@pytest.mark.parametrize(
    "override, message",
    [
        ("strategy.num_stages=0", "strategy.num_stages=0 is invalid"),
        ("strategy.num_stages=-2", "strategy.num_stages=-2 is invalid"),
        ("strategy.num_micro_batches=0", "strategy.num_micro_batches=0 is invalid"),
        ("strategy.checkpoint=sometimes", "strategy.checkpoint='sometimes' is not a checkpoint mode"),
        ("strategy.balance=fastest", "strategy.balance='fastest' is not a balancing mode"),
        ("strategy.balance=7", "strategy.balance=7 is invalid"),
        ("strategy.balance=[3,0]", "strategy.balance=[3, 0] is invalid"),
        ("strategy.balance=[4,2,2]", "strategy.balance=[4, 2, 2] has 3 entries but strategy.num_stages=2"),
        ("strategy.start_method=thread", "strategy.start_method='thread' is not a start method"),
        ("+strategy.chunks=8", "strategy.chunks is not a GPipeStrategy setting"),  # '+' forces a new key in
        ("trainer.devices=3", "trainer.devices=3 on trainer.num_nodes=1 starts 3 processes, not a multiple"),
        ("strategy.mesh_order=[pp,pp]", "strategy.mesh_order=['pp', 'pp'] is invalid"),
    ],
)
def test_invalid_value_fails_validation_naming_the_key(override, message):
    cfg = composed(override)
    with pytest.raises(ValueError) as error:
        validate_config(cfg)
    assert str(error.value).startswith(message)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_every_schedule_composes_and_cuts_the_blocks_into_its_chunks(schedule):
    cfg = composed(f"strategy.schedule={schedule}")
    assert validate_config(cfg) == PipelineParallelConfig(num_stages=2, num_micro_batches=8)
    strategy = instantiate(cfg.strategy, _convert_="all")
    assert strategy._settings.schedule is SCHEDULES[schedule]
    assert strategy.chunk_config.num_stages == {"interleaved_1f1b": 4, "zbv": 4}.get(schedule, 2)


def test_virtual_stages_and_a_balance_per_chunk_configure_the_strategy():
    cfg = composed("strategy.schedule=interleaved_1f1b", "strategy.virtual_stages=3", "strategy.balance=[1,1,2,1,2,1]")
    validate_config(cfg)
    strategy = instantiate(cfg.strategy, _convert_="all")
    assert strategy.chunk_config == PipelineParallelConfig(num_stages=6, num_micro_batches=8)
    assert strategy._settings.balance == [1, 1, 2, 1, 2, 1]


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["strategy.schedule=2f2b"], "strategy.schedule='2f2b' is not a schedule; use one of 'gpipe', '1f1b'"),
        (["strategy.schedule=1f1b", "strategy.virtual_stages=2"],
         "strategy.virtual_stages=2 is invalid for strategy.schedule='1f1b', which runs exactly 1 model chunk per"),
        (["strategy.schedule=interleaved_1f1b", "strategy.balance=[4,4]"],
         "strategy.balance=[4, 4] has 2 entries but strategy.schedule='interleaved_1f1b' cuts the pipelined blocks"
         " into strategy.num_stages * strategy.virtual_stages = 2 * 2 = 4 model chunks"),
    ],
    ids=["unknown", "chunks-for-1f1b", "balance-per-stage"],
)
def test_invalid_schedule_setting_fails_validation_naming_the_key(overrides, message):
    """The config tree's overrides reach the checks of every setting (tests/test_settings.py has them all)."""
    with pytest.raises(ValueError) as error:
        validate_config(composed(*overrides))
    assert str(error.value).startswith(message)


@pytest.mark.parametrize(
    "override, key",
    [
        ("strategy.num_stages=two", "strategy.num_stages"),  # a type OmegaConf checks from the schema
        ("strategy.num_stage=2", "strategy.num_stage"),  # a typo: not a key of the schema
        ("strategy.virtual_stages=two", "strategy.virtual_stages"),
    ],
)
def test_wrong_type_or_unknown_key_fails_composition_naming_the_key(override, key):
    with pytest.raises(ConfigCompositionException) as error:
        composed(override)
    assert key in f"{error.value} {error.value.__cause__}"


@pytest.fixture
def multirun_job():
    """Inside this fixture, Hydra reports a multirun job, as it does to each job of ``train.py -m ...``."""
    cfg = composed(hydra_config=True)
    cfg.hydra.mode = RunMode.MULTIRUN
    HydraConfig.instance().set_config(cfg)
    yield
    HydraConfig.instance().cfg = None


def test_start_method_is_popen_outside_a_sweep(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert composed().strategy.start_method == "popen"


def test_start_method_is_spawn_inside_a_sweep_job(multirun_job, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    for variable in ("SLURM_NTASKS", "TORCHELASTIC_RUN_ID", "LSB_JOBID"):
        monkeypatch.delenv(variable, raising=False)
    assert start_method_for_this_run() == "spawn"


def test_start_method_stays_popen_when_a_launcher_started_the_ranks(multirun_job, monkeypatch):
    # torchrun sets these; Lightning must then start no processes of its own, which only popen does.
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "sweep")
    assert start_method_for_this_run() == "popen"
