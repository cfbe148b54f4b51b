"""GPipeStrategy's settings, checked once where they enter: ``GPipeStrategy(...)`` and the Hydra config.

Constructing a :class:`PipelineSettings` checks every setting, so everything after trusts it. A message starts with
the setting and its value and says the fix (``num_stages=0 is invalid; ...``); under Hydra, ``key="strategy."``
makes it name the config key (``strategy.num_stages=0 is invalid; ...``). What needs more than the settings is
checked where it becomes known: the process count by :func:`check_process_count` (at launch, or from the Hydra
``trainer`` group), the model's blocks and the profiling sample by :mod:`lightning_pipe.partition.balance` (before launch, and
at set-up for models built in ``configure_model``).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import InitVar, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, get_args

import torch

from lightning_pipe.checkpoints.export import parse_size
from lightning_pipe.checkpoints.pretrained import PretrainedWeights, checked_pretrained
from lightning_pipe.partition.counts import PipelineParallelConfig, require_positive_int
from lightning_pipe.execution.tensor_parallel import checked_plan
from lightning_pipe.partition.balance import (
    BALANCE_MODES,
    BalanceMode,
    check_block_counts,
    check_one_count_per_stage,
)
from lightning_pipe.partition.topology import PipelineLayout
from lightning_pipe.reliability.stall_rule import StallRule
from lightning_pipe.schedules.actions import PipelineSchedule, RecomputeMode, StageActions, custom_schedule
from lightning_pipe.schedules.builtin import SCHEDULES
from lightning_pipe.schedules.choice import AUTO
from lightning_pipe.schedules.simulator import check_schedule

# Which forwards run again in backward instead of keeping their activations (the public option ``checkpoint``;
# :func:`lightning_pipe.schedules.actions.with_recompute` decides it per forward).
RECOMPUTE_MODES: tuple[str, ...] = get_args(RecomputeMode)
MESH_ORDERS: tuple[tuple[str, ...], ...] = (
    ("pp", "dp"), ("dp", "pp"), ("pp", "dp", "tp"), ("dp", "pp", "tp"), ("tp", "pp", "dp"), ("tp", "dp", "pp")
)
START_METHODS: tuple[str, ...] = ("popen", "spawn", "fork", "forkserver")
DATA_PARALLEL_MODES: tuple[str, ...] = ("replicate", "shard", "full_shard")
MICRO_BATCHES_PER_STAGE = 4  # the default: GPipe's bubble (S-1)/(M+S-1) is then below a fifth


@dataclass(frozen=True)
class PipelineSettings:
    """The pipeline settings of :class:`~lightning_pipe.GPipeStrategy`, checked: each field is the strategy's argument
    of the same name (``recompute`` is the argument ``checkpoint``); its docstring says what it does. docs/api.md
    holds the same as a table with the defaults.

    ``key`` prefixes the settings' names in error messages: ``"strategy."`` for a Hydra config.
    """

    num_stages: int | None = None
    """Pipeline stages; defaults to the number of processes (``devices * num_nodes``). A
    :class:`PipelineParallelConfig`, or a mapping such as a Hydra/OmegaConf node with ``num_stages`` and
    ``num_micro_batches``, may be passed here instead of both counts."""
    num_micro_batches: int | None = None
    """Micro-batches per mini-batch; defaults to ``4 * num_stages``, where GPipe's idle bubble becomes negligible."""
    recompute: RecomputeMode | None = None
    """The argument ``checkpoint``, activation re-computation: ``"always"``, ``"except_last"`` (every forward but
    those whose backward follows next: in GPipe the last micro-batch's) or ``"never"``. By default ``"except_last"``
    under GPipe, ``"never"`` under a per-micro-batch schedule, which holds few micro-batches' activations anyway."""
    balance: list[int] | BalanceMode | None = None
    """Blocks per stage, e.g. ``[3, 5]``, or how to choose them: ``"uniform"`` (the default: equal block counts),
    ``"parameters"`` (equal parameter counts), ``"time"`` (equal forward + backward time, profiled per block on the
    device) or ``"memory"`` (equal parameter + activation bytes, profiled). The profiled modes run on ``sample``,
    else ``example_input_array``, else in a fit on the first training batch (through the training step); every rank
    applies the split that global rank 0 decided."""
    module_name: str | tuple[str, ...] | None = None
    """Dotted path of the ``nn.Sequential`` or ``nn.ModuleList`` to pipeline (``"net.model"``), or consecutive
    sibling modules (``["model.conv1", ..., "model.fc"]``); by default the outermost container, or chain observed on
    ``example_input_array``, with the most parameters, and where that leaves more than a fifth of them outside, the
    chain the training step calls on the first training batch, if one splits better (see
    :func:`lightning_pipe.partition.region.chosen_region`; a region of fewer blocks than stages is refused, naming the
    chain to give here)."""
    sample: Any = field(default=None, compare=False, repr=False)
    """An input of the LightningModule's ``forward`` (as ``example_input_array``, which is used when this is
    ``None``) to profile the blocks with for ``balance="time"`` or ``"memory"`` and ``schedule="auto"``; with neither,
    a fit profiles on its first training batch."""
    trace_steps: tuple[int, ...] = ()
    """Training steps (``trainer.global_step`` values) whose timeline of every stage is written as a Chrome trace to
    ``trace_dir/gpipe_trace.json``, whose absolute path is printed when it is first written (see
    :mod:`lightning_pipe.trace`)."""
    trace_dir: Path | None = None
    """Where the trace goes; defaults to the Trainer's ``default_root_dir``."""
    log_bubble_fraction: bool = True
    """Send ``pipeline/bubble_fraction`` (the measured idle share of a step's compute window) and
    ``pipeline/ideal_bubble_fraction`` (``(S-1)/(M+S-1)``) to the loggers every ``log_every_n_steps``. Costs a few
    clock readings per micro-batch and one small gather over the pipeline per logged step."""
    deferred_batch_norm: bool = False
    """Update BatchNorm running statistics once per mini-batch, from the whole mini-batch's statistics, so that they
    equal one device's. By default (GPipe's semantics) each micro-batch updates them with its own statistics. Either
    way each micro-batch is normalised by its own statistics."""
    mesh_order: tuple[str, ...] = ("pp", "dp")
    """How ranks are laid out over the pipeline (``"pp"``), data-parallel (``"dp"``) and tensor-parallel (``"tp"``)
    dimensions, outermost first, when ``devices * num_nodes`` is a multiple of ``num_stages * tensor_parallel_size``
    (the replicas of the pipeline average their gradients). ``("pp", "dp")``, as in torchtitan and Megatron, keeps
    the heavier gradient all-reduce on the fast links inside a node and sends only activations across nodes; the
    tensor-parallel dimension is innermost unless named (``("tp", "pp", "dp")``): a stage's tensor-parallel ranks
    talk in every block, so they belong on one node."""
    data_parallel: str = "replicate"
    """What the data-parallel replicas of a stage hold (when ``devices * num_nodes`` is a multiple of
    ``num_stages``): ``"replicate"`` (the default: every replica holds the stage's whole parameters, gradients and
    optimizer state, and the replicas average their gradients in one all-reduce), ``"shard"`` (each block of the
    stage sharded over its replicas with torch's FSDP2, ``fully_shard``: weights gathered once per step and kept
    for all its micro-batches, gradients reduce-scattered once per optimizer step, optimizer state sharded: ZeRO-2)
    or ``"full_shard"`` (the same, the weights gathered again for each micro-batch's forward and backward: ZeRO-3,
    least memory, more communication). docs/memory.md says when to pick which."""
    tensor_parallel_size: int = 1
    """Ranks splitting each stage's blocks with tensor parallelism (torch's DTensor ``parallelize_module``): ``devices
    * num_nodes = num_stages * replicas * tensor_parallel_size``. Each block's layers named by
    ``tensor_parallel_plan`` (by default a Hugging Face model's own ``config.base_model_tp_plan``) are split
    column-wise or row-wise over the stage's ``tensor_parallel_size`` ranks; the rest of the block (norms) and the
    modules outside the blocks (embeddings, head) stay whole on every rank. Activations travel between stages'
    ranks of the same tensor-parallel index. See docs/guide.md, "Three dimensions"."""
    tensor_parallel_plan: Any = field(default=None, compare=False, repr=False)
    """With ``tensor_parallel_size > 1``: how to split a block. A mapping from module names inside a block (``"*"``
    matches one name part) to torch ``ParallelStyle``\ s or the strings ``"colwise"`` / ``"rowwise"``
    (``{"attn.qkv": "colwise", "attn.out": "rowwise", "mlp.up": "colwise", "mlp.down": "rowwise"}``), or a function
    ``fn(block, tp_mesh)`` that parallelizes one block itself. ``None`` (the default): the plan of the Hugging Face
    model holding the blocks (``config.base_model_tp_plan``, its entries for the blocks). Checked at set-up against
    the blocks: every name must match a linear layer, every split width and head count divide by the size."""
    start_method: str = "popen"
    """``"popen"`` (re-run the script per process), ``"spawn"``, ``"fork"`` or ``"forkserver"``, as for DDP."""
    save_distributed_checkpoint: bool | None = None
    """Write checkpoints sharded with ``torch.distributed.checkpoint`` (a directory): every rank writes its own stage,
    nothing is gathered on one host. Such a checkpoint resumes with any stage count (only the local share is read);
    ``lightning-pipe consolidate_checkpoint DIR FILE`` turns it into one file that loads anywhere.
    ``False``: the whole model is gathered to rank 0, which writes one file that loads anywhere (with
    ``load_from_checkpoint``, on one device) and holds the whole model and its optimizer state while writing. By
    default (``None``) sharded for a model built on the meta device (in ``configure_model()`` or under
    ``init_module(empty_init=True)``), one file otherwise."""
    gather_model_after_run: bool = False
    """After ``fit``, ``validate``, ``test`` or ``predict`` of a model built on the meta device, send every stage's
    blocks to global rank 0 (the last stage, the launching process), so that the user's model object there holds the
    whole trained model, as on one device. Costs rank 0 the whole model in host memory. By default each rank keeps
    only its own stage (the other blocks stay on the meta device) and the trained model lives in the checkpoints. A
    model built the usual way always comes back whole on every rank."""
    schedule: str | PipelineSchedule | StageActions = field(default="gpipe", compare=False)
    """The order of each stage's forwards, backwards, sends and receives in a step (see docs/schedules.md):
    ``"gpipe"`` (the default; the loss on the whole batch), or a schedule with a loss per micro-batch, for which
    ``training_step`` runs once per micro-batch: ``"1f1b"`` (at most ``S - stage`` micro-batches' activations held),
    ``"interleaved_1f1b"`` (``virtual_stages`` model chunks per stage: a smaller bubble), ``"zero_bubble"`` (backward
    split into input and weight gradients, the latter filling the bubble) or ``"zbv"`` (two chunks per stage in a
    V). Or a function ``(stage, num_stages, num_micro_batches, virtual_stages) -> list[Action]`` (see
    :mod:`lightning_pipe.schedules`). Or ``"auto"``: at set-up, global rank 0 profiles the blocks and every rank
    takes the configuration predicted fastest within ``memory_budget`` (schedule among ``gpipe``, ``1f1b``,
    ``interleaved_1f1b`` and ``zero_bubble``; ``num_micro_batches``, ``virtual_stages`` and ``checkpoint`` where
    they are left unset); docs/schedules.md "Choosing a schedule". Once checked, a :class:`PipelineSchedule`."""
    virtual_stages: int | None = None
    """Model chunks per stage for the schedules that interleave them (``"interleaved_1f1b"``: 2 by default;
    ``"zbv"``: 2); the pipelined blocks are split into ``num_stages * virtual_stages`` chunks. Once checked, the
    count (1 for the other schedules)."""
    compile: bool | dict[str, Any] = False
    """Compile each stage's blocks with ``torch.compile`` (``True``), or with these keyword arguments of
    ``torch.compile`` (``{"mode": "max-autotune"}``): every block separately, as torchtitan compiles each block (with
    ``data_parallel="shard"`` or ``"full_shard"``, compiled and then sharded, torchtitan's order: FSDP2's hooks run
    outside the compiled code). A ``torch.compile`` wrapper around the pipelined module is honoured the same way, with
    its settings (see :mod:`lightning_pipe.execution.compiling`)."""
    pretrained: PretrainedWeights | None = None
    """Start from stored weights, each rank reading only its stage's and the replicated modules' tensors: the path
    of a Hugging Face model directory (safetensors, single or sharded, or ``pytorch_model.bin``), of a weights file,
    or of a checkpoint of this package; or :class:`~lightning_pipe.PretrainedWeights` with the ``prefix`` where the
    stored model sits in the LightningModule (inferred by default) and the ``dtype`` (the precision's, or the stored
    one). Checked against the whole model on every rank before the first step (see
    :mod:`lightning_pipe.checkpoints.pretrained`); a model object loads them once (a later ``trainer.test`` keeps
    what ``fit`` trained). A path or a mapping enters; :class:`PretrainedWeights` once checked."""
    init_module: Callable[[str, torch.nn.Module], None] | None = field(default=None, compare=False, repr=False)
    """How to initialise a model built on the meta device (in ``configure_model()`` or under
    ``init_module(empty_init=True)``) once its tensors are allocated on their stage: a function ``fn(name, module)``
    called for every module holding parameters or buffers of its own (``name``: its qualified name in the
    LightningModule), the random generators seeded by the name, that fills them in place. It replaces the built-in
    rule (``reset_parameters()``; inside a Hugging Face model, the model's ``_init_weights``), for models whose
    modules have neither; ``lightning_pipe.init_weights(model, init_module=fn)`` starts a one-device run alike (see
    :mod:`lightning_pipe.execution.materialize`). Under ``start_method="spawn"`` it must be importable (a
    module-level function)."""
    memory_budget: int | str | None = None
    """With ``schedule="auto"``: the bytes each device may spend on its stage's parameters, their gradients and its
    peak activations (``"40GB"``, ``"512MiB"`` or a byte count); by default what the device has (a GPU's total
    memory; on the CPU the machine's physical memory over the local processes). The optimizer's state is not
    counted: leave room for it."""
    stall_watchdog: bool = True
    """End the run on every rank when, in a training step, a wait on another rank (activations, gradients, the
    step's results, the gradient reductions and barriers) lasts longer than ``max(stall_floor, stall_multiple * the
    slowest recent step)``, or the first step's bound in a first step, naming the rank that stopped and writing every
    rank's Python stack to ``default_root_dir/stall_stacks/`` (see :mod:`lightning_pipe.reliability.watchdog`). A
    sharded checkpoint's save is bounded by ``max(stall_floor, stall_multiple * the slowest earlier save)`` (the
    first save as a first step, by the set-up's time). Validation, one-file checkpoints and epoch ends are left to the strategy's
    ``timeout``, which stays the hard limit everywhere."""
    stall_multiple: float = StallRule.multiple
    """How many times the slowest of the last 100 regular training steps a wait may last."""
    stall_floor: float = StallRule.floor_s
    """The shortest bound, in seconds (a ``timedelta`` is accepted and converted)."""
    stall_first_step: float | None = StallRule.first_step_s
    """The bound on a wait in a first step (a run's first two, an epoch's first, the first after validation or a
    checkpoint, the first with a batch of new shapes), which may compile or allocate for long: seconds or a
    ``timedelta``. ``None`` (the default) derives it from what the set-up measured: ``max(2 * stall_floor,
    stall_multiple * the set-up's seconds)``, 600 s when ``torch.compile`` compiles in the first steps (see
    :class:`~lightning_pipe.reliability.stall_rule.StallRule`). Where the regular bound is longer, that one."""
    key: InitVar[str] = ""

    def __post_init__(self, key: str) -> None:
        num_stages, num_micro_batches = self.num_stages, self.num_micro_batches
        if isinstance(num_stages, (PipelineParallelConfig, Mapping)):
            num_stages, num_micro_batches = counts_from_config(num_stages, num_micro_batches)
        for name, count in (("num_stages", num_stages), ("num_micro_batches", num_micro_batches)):
            if count is not None:
                require_positive_int(f"{key}{name}", count)
        schedule = _checked_schedule(self.schedule, key, num_stages, num_micro_batches, self.virtual_stages)
        virtual_stages = schedule.checked_virtual_stages(self.virtual_stages, key)
        auto = schedule is AUTO  # what is left unset stays None: the choice at set-up fills it
        if auto and self.virtual_stages is None:
            virtual_stages = None  # type: ignore[assignment]
        recompute = None if auto and self.recompute is None else self.recompute
        checked = {
            "num_stages": num_stages,
            "num_micro_batches": num_micro_batches,
            "recompute": default_recompute(schedule) if recompute is None and not auto else (
                recompute if recompute is None else validate_recompute_mode(recompute, key)
            ),
            "balance": _checked_balance(self.balance, num_stages, key, virtual_stages or 1, schedule.name),
            "module_name": _checked_module_name(self.module_name, key),
            "trace_steps": _checked_trace_steps(self.trace_steps, key),
            "trace_dir": _checked_trace_dir(self.trace_dir, key),
            "mesh_order": _checked_mesh_order(self.mesh_order, key),
            "data_parallel": _checked_data_parallel(self.data_parallel, key),
            "tensor_parallel_size": _checked_tensor_parallel_size(self.tensor_parallel_size, key),
            "tensor_parallel_plan": checked_plan(self.tensor_parallel_plan, f"{key}tensor_parallel_plan"),
            "start_method": _checked_start_method(self.start_method, key),
            "schedule": schedule,
            "virtual_stages": virtual_stages,
            "compile": _checked_compile(self.compile, key),
            "pretrained": checked_pretrained(self.pretrained, key),
            "init_module": _checked_init_module(self.init_module, key),
            "stall_multiple": _checked_stall_multiple(self.stall_multiple, key),
            "stall_floor": _checked_stall_floor(self.stall_floor, key),
            "stall_first_step": _checked_stall_first_step(self.stall_first_step, key),
            "memory_budget": _checked_memory_budget(self.memory_budget, auto, key),
        }

        for name in ("log_bubble_fraction", "deferred_batch_norm", "save_distributed_checkpoint",
                     "gather_model_after_run", "stall_watchdog"):
            value = getattr(self, name)
            if not (isinstance(value, bool) or (value is None and name == "save_distributed_checkpoint")):
                choices = "True, False or None (the default)" if name == "save_distributed_checkpoint" else "True or False"
                raise ValueError(f"{key}{name}={value!r} is invalid; use {choices}.")
        for name, value in checked.items():  # the checked, normalised values (a frozen dataclass)
            object.__setattr__(self, name, value)
        _refuse_with_sharding(checked["data_parallel"], self.deferred_batch_norm, key)
        if checked["tensor_parallel_size"] > 1:
            _refuse_with_tensor_parallel(checked, self.deferred_batch_norm, key)
        if num_stages is not None:  # else the strategy does once the process count is known
            self.check_schedule(self.pipeline_config(num_stages))

    @classmethod
    def from_options(cls, options: Mapping[str, Any], key: str = "") -> PipelineSettings:
        """The settings from ``GPipeStrategy``'s keyword arguments by their public names (``checkpoint``), as a
        Hydra ``strategy`` node holds them."""
        options = {name: value for name, value in options.items() if name != "_target_"}
        if "checkpoint" in options:
            options["recompute"] = options.pop("checkpoint")
        return cls(**options, key=key)

    @property
    def is_auto(self) -> bool:
        """Whether the schedule is chosen at set-up (``schedule="auto"``), not yet known."""
        return self.schedule is AUTO

    @property
    def compile_options(self) -> dict[str, Any] | None:
        """The keyword arguments of ``torch.compile`` for each block of a stage, or ``None`` when not compiling."""
        if isinstance(self.compile, bool):
            return {} if self.compile else None
        return self.compile

    def check_schedule(self, config: PipelineParallelConfig) -> None:
        """Run the user's own schedule through :func:`~lightning_pipe.schedules.simulator.check_schedule` for the counts of
        ``config`` (the built-in schedules are checked by the tests), before any process starts."""
        schedule: PipelineSchedule = self.schedule  # type: ignore[assignment]  (checked in __post_init__)
        if not _is_built_in(schedule):
            check_schedule(schedule, config.num_stages, config.num_micro_batches, self.virtual_stages)

    @property
    def stall_rule(self) -> StallRule | None:
        """The stall watchdog's rule, or ``None`` when it is turned off."""
        return StallRule(self.stall_multiple, self.stall_floor, self.stall_first_step) if self.stall_watchdog else None

    def pipeline_config(self, num_processes: int) -> PipelineParallelConfig:
        """The stage and micro-batch counts; without settings, one stage per process of ``num_processes`` and
        ``MICRO_BATCHES_PER_STAGE`` micro-batches per stage."""
        num_stages = self.num_stages or max(1, num_processes // self.tensor_parallel_size)
        return PipelineParallelConfig(num_stages, self.num_micro_batches or MICRO_BATCHES_PER_STAGE * num_stages)

    def check_counts(self, num_processes: int, num_nodes: int) -> None:
        """What these settings could not check alone, once the launch knows the process count (``num_processes``
        on each of ``num_nodes`` nodes): whole pipelines, a block count per stage, the user's schedule."""
        total = num_processes * num_nodes
        if self.num_stages is not None or self.tensor_parallel_size > 1:
            check_process_count(self.pipeline_config(total).num_stages, num_processes, num_nodes,
                                tensor_parallel=self.tensor_parallel_size)
        elif isinstance(self.balance, list):  # with num_stages set, __post_init__ compared the two
            check_one_count_per_stage(self.balance, self.pipeline_config(total).num_stages,
                                      virtual_stages=self.virtual_stages or 1, schedule=self.schedule.name)  # type: ignore[union-attr]
        config = self.pipeline_config(total)  # validates the resolved counts
        check_data_parallel(self.data_parallel, config.num_stages * self.tensor_parallel_size, num_processes, num_nodes)
        if self.num_stages is None:  # with num_stages set, __post_init__ ran the user's schedule already
            self.check_schedule(config)

    def layout(self, num_processes: int) -> PipelineLayout:
        """Which of ``num_processes`` ranks holds which stage of which replica, at which tensor-parallel index
        (``num_stages * replicas * tensor_parallel_size``)."""
        num_stages, tensor_parallel = self.pipeline_config(num_processes).num_stages, self.tensor_parallel_size
        loss_stage = self.schedule.loss_stage(num_stages, self.virtual_stages or 1)  # type: ignore[union-attr]
        return PipelineLayout(
            num_stages, max(1, num_processes // (num_stages * tensor_parallel)),
            pipeline_outermost=[name for name in self.mesh_order if name != "tp"][0] == "pp",
            loss_on_first_stage=num_stages > 1 and loss_stage == 0,
            tensor_parallel=tensor_parallel, tensor_parallel_innermost=self.mesh_order[0] != "tp",
        )

    def chunk_config(self, num_processes: int) -> PipelineParallelConfig:
        """The counts the partition splits the blocks by: one part per model chunk (``virtual_stages`` per stage)."""
        config = self.pipeline_config(num_processes)
        return PipelineParallelConfig(config.num_stages * (self.virtual_stages or 1), config.num_micro_batches)


def _checked_schedule(
    schedule: object, key: str, num_stages: int | None, num_micro_batches: int | None, virtual_stages: object
) -> PipelineSchedule:
    """The schedule: one named in ``SCHEDULES``, a :class:`PipelineSchedule`, or the user's function wrapped into one
    (whether it needs a loss per micro-batch is read from its lists for the configured counts, or 2 stages and 8
    micro-batches when they are not set)."""
    if isinstance(schedule, str) and schedule in SCHEDULES:
        return SCHEDULES[schedule]
    if schedule == "auto":
        return AUTO
    if isinstance(schedule, PipelineSchedule):
        return schedule
    if isinstance(schedule, str) or not callable(schedule):
        raise ValueError(
            f"{key}schedule={schedule!r} is not a schedule; use one of {', '.join(map(repr, SCHEDULES))}, 'auto' or a"
            " function"
            " (stage, num_stages, num_micro_batches, virtual_stages) -> list[Action] (see lightning_pipe.schedules)."
        )
    chunks = virtual_stages if isinstance(virtual_stages, int) and not isinstance(virtual_stages, bool) else 1
    return custom_schedule(schedule, num_stages or 2, num_micro_batches, max(1, chunks))  # type: ignore[arg-type]


def _is_built_in(schedule: PipelineSchedule) -> bool:
    return SCHEDULES.get(schedule.name) is schedule or schedule is AUTO


def _checked_memory_budget(budget: Any, auto: bool, key: str) -> int | None:
    """Bytes from a count or a size (``"40GB"``); only ``schedule="auto"`` uses it."""
    if budget is None:
        return None
    if not auto:
        raise ValueError(
            f"{key}memory_budget={budget!r} is set but {key}schedule is not 'auto': only the automatic choice reads"
            f" the budget; set {key}schedule='auto', or leave {key}memory_budget unset."
        )
    try:
        size = parse_size(budget) if isinstance(budget, (str, int)) and not isinstance(budget, bool) else None
    except ValueError:
        size = None
    if size is None or size <= 0:
        raise ValueError(
            f"{key}memory_budget={budget!r} is invalid; give the bytes each device may hold as a positive count or a"
            " size such as '40GB' or '512MiB', or leave it unset for what the device has."
        )
    return size


def default_recompute(schedule: PipelineSchedule) -> RecomputeMode:
    """The re-computation a schedule runs with unless told: GPipe holds every micro-batch's activations until its
    backward, so it re-computes all but the last; a per-micro-batch schedule bounds them already, and keeps them."""
    return "never" if schedule.per_micro_batch else "except_last"


def validate_recompute_mode(mode: object, key: str = "") -> RecomputeMode:
    """``mode`` if it is a re-computation mode; else a ``ValueError`` naming the choices (by the public option's
    name, ``checkpoint``)."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(
            f"{key}checkpoint={mode!r} is not a checkpoint mode; use one of {', '.join(map(repr, RECOMPUTE_MODES))}"
            " ('except_last' re-computes every micro-batch's forward in backward except the last one)."
        )
    return mode  # type: ignore[return-value]


def check_process_count(
    num_stages: int, devices: int, num_nodes: int, key: str = "", trainer_key: str = "", tensor_parallel: int = 1
) -> None:
    """Raise unless ``devices * num_nodes`` processes hold whole pipelines of ``num_stages`` stages, each stage split
    over ``tensor_parallel`` ranks. ``key`` and ``trainer_key`` prefix the names in the message (``"strategy."`` and
    ``"trainer."`` under Hydra)."""
    total = devices * num_nodes
    if tensor_parallel > 1 and total % (num_stages * tensor_parallel):
        per_replica = num_stages * tensor_parallel
        raise ValueError(
            f"{trainer_key}devices={devices} on {trainer_key}num_nodes={num_nodes} starts {total} processes, not a"
            f" multiple of {key}num_stages={num_stages} x {key}tensor_parallel_size={tensor_parallel} = {per_replica}:"
            " each stage of each pipeline replica runs on tensor_parallel_size processes; set"
            f" {trainer_key}devices to {per_replica} for one pipeline or to a multiple of it for data-parallel"
            f" replicas, or choose a {key}num_stages and {key}tensor_parallel_size whose product divides {total}."
        )
    if total % num_stages:
        raise ValueError(
            f"{trainer_key}devices={devices} on {trainer_key}num_nodes={num_nodes} starts {total} processes, not a"
            f" multiple of {key}num_stages={num_stages}: GPipe needs devices * num_nodes to be a multiple of the stage"
            f" count (one process per stage of each pipeline replica); set {trainer_key}devices to {num_stages} for"
            f" one pipeline or to a multiple of it for data-parallel replicas, or choose a {key}num_stages that"
            f" divides {total}."
        )


def check_data_parallel(
    mode: str, num_stages: int, devices: int, num_nodes: int, key: str = "", trainer_key: str = ""
) -> None:
    """Raise when ``mode`` shards a stage over its replicas but ``devices * num_nodes`` processes make one replica:
    there would be nothing to shard over."""
    if mode == "replicate" or devices * num_nodes > num_stages:
        return
    raise ValueError(
        f"{key}data_parallel={mode!r} shards each stage over its data-parallel replicas, but {trainer_key}devices="
        f"{devices} on {trainer_key}num_nodes={num_nodes} with {key}num_stages={num_stages} make one replica of the"
        f" pipeline: nothing to shard over. Use {key}data_parallel='replicate' (the default), or set"
        f" {trainer_key}devices to a multiple of {num_stages} (2 * {num_stages} for two replicas)."
    )


def counts_from_config(
    config: PipelineParallelConfig | Mapping[str, Any], num_micro_batches: int | None
) -> tuple[int | None, int | None]:
    """``(num_stages, num_micro_batches)`` from a config object or mapping (a Hydra/OmegaConf node)."""
    if num_micro_batches is not None:
        raise ValueError("pass num_micro_batches inside the config, or pass both counts as plain integers, not both.")
    if isinstance(config, PipelineParallelConfig):
        return config.num_stages, config.num_micro_batches
    unknown = set(config) - {"num_stages", "num_micro_batches"}
    if unknown:
        raise ValueError(
            f"unknown pipeline config keys {sorted(unknown)}; a pipeline config holds num_stages and num_micro_batches."
        )
    return config.get("num_stages"), config.get("num_micro_batches")


def _checked_balance(
    balance: Any, num_stages: int | None, key: str, virtual_stages: int = 1, schedule: str = ""
) -> list[int] | BalanceMode | None:
    if balance is None:
        return None
    if isinstance(balance, str):
        if balance not in BALANCE_MODES:
            raise ValueError(
                f"{key}balance={balance!r} is not a balancing mode; use one of {', '.join(map(repr, BALANCE_MODES))},"
                " or a list of blocks per stage such as [3, 5]."
            )
        return balance  # type: ignore[return-value]
    if not _is_list_like(balance):
        example = ", ".join(["4"] * (num_stages or 2))
        raise ValueError(
            f"{key}balance={balance!r} is invalid; give one block count per stage as a list"
            f" (e.g. {key}balance=[{example}]), a mode ({', '.join(BALANCE_MODES)}), or None for an even split."
        )
    sizes = list(balance)
    check_block_counts(sizes, key)
    if num_stages is not None:
        check_one_count_per_stage(sizes, num_stages, key, True, virtual_stages, schedule)
    return sizes


def _checked_module_name(module_name: Any, key: str) -> str | tuple[str, ...] | None:
    if module_name is None or isinstance(module_name, str):
        return module_name
    names = list(module_name) if _is_list_like(module_name) else None
    if not names or any(not isinstance(name, str) for name in names):
        raise ValueError(
            f"{key}module_name={module_name!r} is invalid; give the dotted path of the nn.Sequential or nn.ModuleList"
            " to pipeline as a string (e.g. 'net.model'), a list of consecutive sibling modules (e.g."
            " ['model.conv1', 'model.layer1', 'model.fc']), or None to pipeline the one with the most parameters."
        )
    return tuple(names)


def _checked_trace_steps(trace_steps: Any, key: str) -> tuple[int, ...]:
    steps = list(trace_steps) if _is_list_like(trace_steps) else None
    if steps is None or any(isinstance(step, bool) or not isinstance(step, int) or step < 0 for step in steps):
        raise ValueError(
            f"{key}trace_steps={trace_steps!r} is invalid; give the training steps to trace as a list of"
            f" trainer.global_step values (integers from 0), e.g. {key}trace_steps=[20]."
        )
    return tuple(steps)


def _checked_trace_dir(trace_dir: Any, key: str) -> Path | None:
    if trace_dir is None:
        return None
    if not isinstance(trace_dir, (str, os.PathLike)):
        raise ValueError(
            f"{key}trace_dir={trace_dir!r} is invalid; give a directory path, or None for the Trainer's"
            " default_root_dir."
        )
    return Path(trace_dir)


def _checked_mesh_order(mesh_order: Any, key: str) -> tuple[str, ...]:
    order = tuple(mesh_order) if _is_list_like(mesh_order) else None
    if order not in MESH_ORDERS:
        raise ValueError(
            f"{key}mesh_order={_shown(mesh_order)} is invalid; use ['pp', 'dp'] (pipeline outermost: a replica's"
            " gradient all-reduce stays among neighbouring ranks, one node) or ['dp', 'pp'] (a pipeline's stages on"
            " neighbouring ranks), with 'tp' (tensor parallel) last (the default) or first: ['pp', 'dp', 'tp']."
        )
    return order  # type: ignore[return-value]


def _checked_tensor_parallel_size(size: Any, key: str) -> int:
    require_positive_int(f"{key}tensor_parallel_size", size)
    return size  # type: ignore[no-any-return]


def _checked_data_parallel(mode: Any, key: str) -> str:
    if mode not in DATA_PARALLEL_MODES:
        raise ValueError(
            f"{key}data_parallel={mode!r} is invalid; use 'replicate' (every replica holds the whole stage, the"
            " default), 'shard' (each block sharded over the replicas with FSDP2, gathered once per step) or"
            " 'full_shard' (gathered again for every micro-batch: least memory)."
        )
    return mode  # type: ignore[no-any-return]


def _refuse_with_sharding(mode: str, deferred_batch_norm: bool, key: str) -> None:
    """The combinations with a sharded stage not shown equal to one device yet, refused rather than run differently.
    (``compile`` is shown: tests/test_sharded_data_parallel.py.)"""
    if mode != "replicate" and deferred_batch_norm:
        raise ValueError(
            f"{key}data_parallel={mode!r} with {key}deferred_batch_norm=True is not supported yet: a block sharded with"
            " FSDP2 has not been shown to train as on one device with it. Use"
            f" {key}data_parallel='replicate' with {key}deferred_batch_norm, or leave {key}deferred_batch_norm out."
        )


# The schedules shown to train as one device does with split blocks (tests/test_tensor_parallel.py).
TENSOR_PARALLEL_SCHEDULES = ("gpipe", "1f1b", "auto")


def _refuse_with_tensor_parallel(checked: dict[str, Any], deferred_batch_norm: bool, key: str) -> None:
    """The combinations with split blocks not shown equal to one device yet, refused rather than run differently."""
    size = checked["tensor_parallel_size"]
    refused = [(name, value) for name, value in (
        ("compile", checked["compile"]), ("deferred_batch_norm", deferred_batch_norm),
        ("data_parallel", checked["data_parallel"] if checked["data_parallel"] == "full_shard" else False),
        ("schedule", checked["schedule"].name if checked["schedule"].name not in TENSOR_PARALLEL_SCHEDULES else False),
    ) if value not in (False, None)]
    if refused:
        name, value = refused[0]
        raise ValueError(
            f"{key}tensor_parallel_size={size} with {key}{name}={value!r} is not supported yet: blocks split with"
            f" tensor parallelism have not been shown to train as on one device with it. Use {key}tensor_parallel_size"
            f"=1 with {key}{name}={value!r}, or"
            + (f" one of the schedules {', '.join(map(repr, TENSOR_PARALLEL_SCHEDULES))}." if name == "schedule" else
               " data_parallel='shard'." if name == "data_parallel" else f" leave {key}{name} out.")
        )


def _checked_start_method(start_method: Any, key: str) -> str:
    if start_method not in START_METHODS:
        raise ValueError(
            f"{key}start_method={start_method!r} is not a start method; use one of"
            f" {', '.join(map(repr, START_METHODS))}, or leave it out for the default."
        )
    return start_method  # type: ignore[no-any-return]


def _checked_init_module(init_module: Any, key: str) -> Any:
    """``None`` or a function of ``(name, module)``."""
    if init_module is None or callable(init_module):
        return init_module
    raise ValueError(
        f"{key}init_module={init_module!r} is invalid; use a function fn(name, module) that initialises the"
        " module's parameters and buffers in place, or None (the modules' reset_parameters(), or their Hugging Face"
        " model's _init_weights)."
    )


def _checked_compile(compile: Any, key: str) -> bool | dict[str, Any]:
    """``True``, ``False`` or a plain dict of ``torch.compile``'s keyword arguments (a mapping's keys checked)."""
    if isinstance(compile, bool):
        return compile
    if not isinstance(compile, Mapping):
        raise ValueError(
            f"{key}compile={compile!r} is invalid; use True, False or a mapping of torch.compile's keyword arguments"
            " (e.g. {'mode': 'max-autotune'} or {'backend': 'aot_eager'})."
        )
    accepted = [
        name for name, parameter in inspect.signature(torch.compile).parameters.items()
        if parameter.kind == inspect.Parameter.KEYWORD_ONLY
    ]
    unknown = [name for name in compile if name not in accepted]
    if unknown:
        raise ValueError(
            f"{key}compile={dict(compile)!r} is invalid; {unknown[0]!r} is not a keyword argument of torch.compile,"
            f" whose arguments are {', '.join(accepted)}."
        )
    return _plain(compile)


def _checked_stall_multiple(multiple: Any, key: str) -> float:
    if isinstance(multiple, bool) or not isinstance(multiple, (int, float)) or not multiple >= 1:
        raise ValueError(
            f"{key}stall_multiple={multiple!r} is invalid; a wait may last this many times the slowest recent training"
            f" step, so give a number of at least 1 (default {StallRule.multiple:g}), or turn the watchdog off with"
            f" {key}stall_watchdog=False."
        )
    return float(multiple)


def _checked_stall_floor(floor: Any, key: str) -> float:
    seconds = floor.total_seconds() if isinstance(floor, timedelta) else floor
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(
            f"{key}stall_floor={floor!r} is invalid; give the shortest bound on a wait in seconds, a positive number"
            f" (default {StallRule.floor_s:g}) or a timedelta, or turn the watchdog off with {key}stall_watchdog=False."
        )
    return float(seconds)


def _checked_stall_first_step(first_step: Any, key: str) -> float | None:
    if first_step is None:
        return None  # derived from what the set-up measured
    seconds = first_step.total_seconds() if isinstance(first_step, timedelta) else first_step
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
        raise ValueError(
            f"{key}stall_first_step={first_step!r} is invalid; give the bound on a wait in a first step (a run's first,"
            " an epoch's first, the first after validation or a checkpoint, which may compile or allocate for long) in"
            " seconds, a positive number or a timedelta, or None (the default: derived from what the set-up measured,"
            f" a minute for most models), or turn the watchdog off with {key}stall_watchdog=False."
        )
    return float(seconds)


def _plain(mapping: Mapping[str, Any]) -> dict[str, Any]:
    """``mapping`` as nested plain dicts (torch.compile's ``options`` from a Hydra node is an OmegaConf mapping)."""
    return {name: _plain(value) if isinstance(value, Mapping) else value for name, value in mapping.items()}


def _is_list_like(value: Any) -> bool:
    """A list, tuple or OmegaConf list: iterable with a length, and neither a string nor a mapping."""
    return isinstance(value, Iterable) and hasattr(value, "__len__") and not isinstance(value, (str, bytes, Mapping))


def _shown(value: Any) -> str:
    return repr(list(value)) if _is_list_like(value) else repr(value)
