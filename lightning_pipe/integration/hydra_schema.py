"""Hydra support: the schema of the ``strategy`` config group, its validation, and sweep-safe process launching.

``import lightning_pipe.integration.hydra_schema`` (before Hydra composes) registers two things:

* ``strategy/gpipe_schema`` in Hydra's ConfigStore, the structured config that ``conf/strategy/gpipe.yaml``
  extends. OmegaConf then rejects unknown keys and wrongly typed values, naming the key; values it cannot judge
  (a stage count of 0, an unknown checkpoint mode, ``balance`` as a list, a mode name or null) are checked by
  :func:`validate_config` with the rules :class:`GPipeStrategy(...) <lightning_pipe.GPipeStrategy>` applies
  (:mod:`lightning_pipe.settings`).
* the ``${lightning_pipe.start_method:}`` resolver, which chooses how the Trainer starts its processes: Lightning's
  default launcher re-runs ``sys.argv`` for every rank, and inside ``python train.py -m ...`` that is the whole
  sweep again. Inside a multirun job the resolver answers ``"spawn"``, so each job starts its own processes and
  ends with them; everywhere else it answers ``"popen"``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import get_method
from lightning.fabric.plugins.environments import (
    LSFEnvironment,
    MPIEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)
from omegaconf import OmegaConf

from lightning_pipe.partition.counts import PipelineParallelConfig
from lightning_pipe.settings import PipelineSettings, check_data_parallel, check_process_count

START_METHOD_RESOLVER = "lightning_pipe.start_method"


@dataclass
class GPipeStrategyConfig:
    """The ``strategy`` group: the arguments of :class:`lightning_pipe.GPipeStrategy`, instantiated by ``_target_``."""

    _target_: str = "lightning_pipe.GPipeStrategy"
    num_stages: int = 2
    """Pipeline stages, one process each; ``trainer.devices * trainer.num_nodes`` must be a multiple of it (the
    multiple is the number of data-parallel replicas of the pipeline)."""
    num_micro_batches: Optional[int] = None
    """Micro-batches per batch; null means ``4 * num_stages``, where GPipe's idle bubble becomes small."""
    checkpoint: Optional[str] = None
    """Activation re-computation: ``always`` (least memory), ``except_last`` or ``never`` (fastest); null:
    ``except_last`` for GPipe, ``never`` for the per-micro-batch schedules."""
    balance: Any = None
    """Blocks per stage as a list (``[3, 5]``), a balancing mode (``uniform``, ``parameters``, ``time``,
    ``memory``), or null for ``uniform``. (``Any``: OmegaConf cannot type a list-or-string field;
    :func:`validate_config` checks it.)"""
    module_name: Any = None
    """Dotted path of the ``nn.Sequential`` or ``nn.ModuleList`` to pipeline, or a list of consecutive sibling
    modules (``[model.conv1, model.bn1, ..., model.avgpool]``); null picks the region with the most parameters.
    (``Any``: OmegaConf cannot type a string-or-list field; :func:`validate_config` checks it.)"""
    start_method: str = "${" + START_METHOD_RESOLVER + ":}"
    """How the Trainer starts its processes; by default ``spawn`` inside a Hydra multirun, else ``popen``."""
    trace_steps: list[int] = field(default_factory=list)
    """Training steps whose timeline of every stage is written as a Chrome trace (``gpipe_trace.json``)."""
    trace_dir: Optional[str] = None
    """Where the trace goes; null means the Trainer's ``default_root_dir``."""
    log_bubble_fraction: bool = True
    """Log the measured idle share of each step (``pipeline/bubble_fraction``) beside the ideal one."""
    deferred_batch_norm: bool = False
    """Update BatchNorm running statistics once per batch, as one device would (default: once per micro-batch)."""
    mesh_order: list[str] = field(default_factory=lambda: ["pp", "dp"])
    """Rank layout over pipeline, data-parallel replicas and tensor-parallel ranks, outermost first, when
    ``trainer.devices * trainer.num_nodes`` is a multiple of ``num_stages``: ``[pp, dp]`` keeps a replica's
    all-reduce within a node; ``tp`` is innermost unless named (``[tp, pp, dp]``)."""
    data_parallel: str = "replicate"
    """What a stage's data-parallel replicas hold: ``replicate`` (each the whole stage; gradients all-reduced),
    ``shard`` (each block sharded over the replicas with FSDP2, gathered once per step: ZeRO-2) or ``full_shard``
    (gathered for every micro-batch: ZeRO-3, least memory)."""
    tensor_parallel_size: int = 1
    """Ranks splitting each stage's blocks with tensor parallelism (DTensor): ``trainer.devices * trainer.num_nodes
    = num_stages * replicas * tensor_parallel_size``."""
    tensor_parallel_plan: Any = None
    """How to split a block: ``{attn.qkv: colwise, attn.out: rowwise}`` (module names inside a block, ``*`` for one
    name part); null: the Hugging Face model's own ``config.base_model_tp_plan``. (``Any``: a mapping;
    :func:`validate_config` checks it.)"""
    save_distributed_checkpoint: Optional[bool] = None
    """Write sharded checkpoints (each rank its own stage) instead of one file gathered on rank 0; null: sharded
    for a model built on the meta device (in ``configure_model``), one file otherwise."""
    gather_model_after_run: bool = False
    """After a run of a model built on the meta device, send the whole model to global rank 0 (costs it the whole
    model in host memory); by default each rank keeps its own stage."""
    schedule: str = "gpipe"
    """The order of each stage's forwards, backwards, sends and receives in a step: ``gpipe``, ``1f1b``,
    ``interleaved_1f1b``, ``zero_bubble`` or ``zbv`` (``lightning_pipe.schedules``; docs/schedules.md compares them),
    or ``auto``: the configuration predicted fastest within ``memory_budget``, chosen at set-up from the profiled
    blocks."""
    memory_budget: Any = None
    """With ``schedule: auto``, the bytes per device for a stage's parameters, gradients and peak activations:
    ``40GB``, ``512MiB`` or a count; null: what the device has. (``Any``: a string or an integer.)"""
    virtual_stages: Optional[int] = None
    """Model chunks per stage, for schedules that run several (``interleaved_1f1b``: 2 or more); null: the
    schedule's default (2 for ``interleaved_1f1b`` and ``zbv``, 1 for the others)."""
    compile: Any = False
    """Compile each stage's blocks with ``torch.compile``: ``true``, or its keyword arguments (``{mode:
    max-autotune}``); every block separately, so no compiled code spans two stages. (``Any``: a bool or a mapping;
    :func:`validate_config` checks it.)"""
    pretrained: Any = None
    """Start from stored weights, each rank reading only its stage's: the path of a Hugging Face model directory
    or weights file, or ``{path: ..., prefix: model., dtype: checkpoint}`` (see ``lightning_pipe.PretrainedWeights``).
    (``Any``: a string or a mapping; :func:`validate_config` checks it.)"""
    init_module: Any = None
    """How to initialise a model built on the meta device, for models whose modules have no ``reset_parameters()``
    and are not Hugging Face models: a function ``fn(name, module)``, given as a node that Hydra instantiates to it,
    ``{_target_: my_project.init_module, _partial_: true}``; null: the built-in rule. (``Any``: a node;
    :func:`validate_config` checks that its target imports as a function.)"""
    stall_watchdog: bool = True
    """End the run when a wait on another rank in a training step lasts longer than ``max(stall_floor, stall_multiple
    * the slowest recent step)`` (the first step's bound in a first step), naming the rank that stopped and writing
    every rank's stack (``stall_stacks/``)."""
    stall_multiple: float = 10.0
    """How many times the slowest of the last 100 regular training steps a wait may last."""
    stall_floor: float = 30.0
    """The shortest bound on a wait, in seconds."""
    stall_first_step: Optional[float] = None
    """The bound on a wait in a first step (a run's first two, an epoch's first, the first after validation or a
    checkpoint, the first with new shapes), in seconds; null derives it from what the set-up measured
    (``max(2 * stall_floor, stall_multiple * the set-up's seconds)``, 600 s while torch.compile compiles); the
    regular bound where that is longer."""


def register_configs() -> None:
    """Store the schema as ``strategy/gpipe_schema`` and register the start-method resolver (idempotent)."""
    ConfigStore.instance().store(group="strategy", name="gpipe_schema", node=GPipeStrategyConfig)
    if not OmegaConf.has_resolver(START_METHOD_RESOLVER):
        OmegaConf.register_new_resolver(START_METHOD_RESOLVER, start_method_for_this_run)


def start_method_for_this_run() -> str:
    """``"spawn"`` inside a Hydra multirun job whose processes Lightning starts itself, else ``"popen"``.

    Why not ``popen`` in a sweep: it re-runs ``sys.argv`` (``-m`` and the whole sweep) for every other rank,
    leaves ``LOCAL_RANK`` set in the sweeping process (so the next job starts no processes) and keeps that
    process's process group alive into the next job. ``spawn`` runs every rank in a child process that ends with
    its job. Where a cluster launcher (torchrun, SLURM's srun, LSF, MPI) has already started one process per rank,
    Lightning must not start any, and only ``popen`` does that.
    """
    if _processes_started_externally():
        return "popen"
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return "spawn"
    return "popen"


def validate_config(config: Mapping[str, Any]) -> PipelineParallelConfig:
    """Check a composed config's ``strategy`` group (and ``trainer``'s process count, when there is a ``trainer``)
    before anything starts; return the resolved stage and micro-batch counts.

    Raises a ``ValueError`` whose message starts with the offending key and value, e.g.
    ``strategy.num_stages=0 is invalid; it must be a positive integer (1 or more).``
    """
    if "strategy" not in config:
        raise ValueError("the config has no 'strategy' group; add '- strategy: gpipe' to its defaults list.")
    pipeline = validate_strategy_config(config["strategy"], key="strategy")
    if "trainer" in config:
        strategy = config["strategy"]
        _check_process_count(config["trainer"], pipeline.num_stages, strategy.get("data_parallel", "replicate"),
                             strategy.get("tensor_parallel_size", 1))
    return pipeline


def validate_strategy_config(strategy: Mapping[str, Any], key: str = "strategy") -> PipelineParallelConfig:
    """Check one ``GPipeStrategy`` config node; errors name ``key.field`` (see :func:`validate_config`)."""
    known = [field.name for field in fields(GPipeStrategyConfig)]
    unknown = [name for name in strategy if name not in known]
    if unknown:
        raise ValueError(
            f"{key}.{unknown[0]} is not a GPipeStrategy setting; the settings are {', '.join(known[1:])}."
        )
    settings = PipelineSettings.from_options(_with_init_module_resolved(strategy, key), key=f"{key}.")
    if settings.num_stages is None:  # the schema's default is 2; only a node made by hand can lack it
        raise ValueError(f"{key}.num_stages is missing; set it to the number of pipeline stages.")
    return settings.pipeline_config(num_processes=settings.num_stages)


def _with_init_module_resolved(strategy: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """The node with ``init_module``, a ``{_target_: ..., _partial_: true}`` node, replaced by the function that
    ``_target_`` names (as ``instantiate`` will make it), so that the settings check a function."""
    node = strategy.get("init_module")
    if not isinstance(node, Mapping):
        return strategy
    target = node.get("_target_")
    try:
        function = get_method(target) if isinstance(target, str) else None
    except Exception:  # Hydra raises its own error for a path that does not import
        function = None
    if function is None or not node.get("_partial_", False):
        raise ValueError(
            f"{key}.init_module={dict(node)!r} is invalid; use {{_target_: my_project.init_module, _partial_: true}},"
            " naming an importable function fn(name, module), or null."
        )
    return {**strategy, "init_module": function}


def _check_process_count(trainer: Mapping[str, Any], num_stages: int, data_parallel: str, tensor_parallel: int) -> None:
    devices, num_nodes = trainer.get("devices", 1), trainer.get("num_nodes", 1)
    if isinstance(devices, bool) or not isinstance(devices, int) or not isinstance(num_nodes, int):
        return  # "auto", a device list or a string: Lightning resolves it, and the strategy checks the result
    check_process_count(num_stages, devices, num_nodes, key="strategy.", trainer_key="trainer.",
                        tensor_parallel=tensor_parallel)
    check_data_parallel(data_parallel, num_stages * tensor_parallel, devices, num_nodes, key="strategy.",
                        trainer_key="trainer.")


def _processes_started_externally() -> bool:
    """Whether a cluster launcher started the ranks (Lightning's own detection order); ``LOCAL_RANK`` marks a rank
    that some launcher, maybe Lightning's own ``popen``, already started."""
    environments = (TorchElasticEnvironment, SLURMEnvironment, LSFEnvironment, MPIEnvironment)
    return "LOCAL_RANK" in os.environ or any(environment.detect() for environment in environments)


register_configs()
