"""Gradients across processes, before the optimizer step: reductions, clipping by the global norm, overflow checks.

Two reductions, both once per optimizer step (after gradient accumulation, like DDP's ``no_sync``):

* over the stages of a pipeline, a parameter held by every stage (an embedding before the pipelined module, a head
  after it) sums each stage's contribution;
* over the data-parallel replicas of a stage, every parameter averages the replicas' gradients.

A parameter that no participating process used keeps ``grad=None``, as on one device, so optimizers skip it.

Then every stage must decide as one device would: clipping by norm uses the norm of the whole model's gradient, and
with a gradient scaler an overflow on one stage skips the step on all of them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_pipe.execution.sharding import (
    DataParallelMode,
    StageSharding,
    local_squared_norm,
    scale_sharded_gradients,
    scaler_refused,
    shard_stage,
)
from lightning_pipe.execution.tensor_parallel import BlockPlans, StageTensorParallel, parallelize_stage
from lightning_pipe.reliability.watchdog import UNWATCHED, StallWatchdog

if TYPE_CHECKING:  # those modules sum their gradients through this one
    from lightning_pipe.execution.outside import OutsideOwnership
    from lightning_pipe.execution.process_groups import PipelineGroups
    from lightning_pipe.execution.stage import StageBlocks
    from lightning_pipe.execution.tied import TiedParameters

def swap_gradients(parameters: list[nn.Parameter], grads: list[Tensor | None]) -> list[Tensor | None]:
    """Give ``parameters`` the gradients ``grads``; their gradients until now are returned.

    A per-micro-batch step runs its backwards inside ``training_step``, but Lightning zeroes the gradients between a
    step and its backward: the step's gradients wait aside (:func:`add_gradients` brings them back in ``backward``),
    and the gradients accumulated before the step are back in place for Lightning to zero or keep."""
    earlier = [p.grad for p in parameters]
    for p, grad in zip(parameters, grads):
        p.grad = grad
    return earlier


def add_gradients(parameters: list[nn.Parameter], grads: list[Tensor | None]) -> None:
    """Accumulate ``grads`` into the parameters' gradients, as backward does."""
    for p, grad in zip(parameters, grads):
        if grad is not None:
            p.grad = grad if p.grad is None else p.grad.add_(grad)


def reduce_gradients(
    parameters: list[nn.Parameter], group: dist.ProcessGroup, average: bool, watchdog: StallWatchdog = UNWATCHED
) -> None:
    """Sum (or average) the gradients of ``parameters`` over ``group``, in one flat all-reduce (a wait ``watchdog``
    bounds)."""
    if not parameters or dist.get_world_size(group) == 1:
        return
    whole = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
    # A parameter split with tensor parallelism (a DTensor): each replica holds the same slice, averaged as it is.
    grads = [g.to_local() if isinstance(g, DTensor) else g for g in whole]
    used = torch.tensor([float(p.grad is not None) for p in parameters], device=grads[0].device)
    flat = torch.cat([g.reshape(-1) for g in grads] + [used.to(grads[0].dtype)])
    what = "the average of the gradients over the replicas" if average else "the sum of the shared parameters' gradients"
    watchdog.wait([dist.all_reduce(flat, group=group, async_op=True)], watchdog.collective(what, group), group)
    if average:
        flat[: flat.numel() - len(parameters)] /= dist.get_world_size(group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    for p, g, users in zip(parameters, whole, flat[offset:].tolist()):
        p.grad = g if users > 0 else None


def clip_grad_norm_over_pipeline(
    parameters: Iterable[nn.Parameter],
    replicated: list[nn.Parameter],
    clip_val: float,
    group: dist.ProcessGroup,
    device: torch.device,
    counted_elsewhere: Iterable[nn.Parameter] = (),
    watchdog: StallWatchdog = UNWATCHED,
    shards: dist.ProcessGroup | None = None,
) -> None:
    """``clip_grad_norm_`` over the whole model: this stage's norm combined with the others' over the pipeline's
    ``group``, the ``replicated`` parameters (identical on every stage after the gradient sum) counted once, and
    the ``counted_elsewhere`` ones (copies of a parameter that another stage also holds) not here. A parameter
    sharded over the replica group ``shards`` (a DTensor, see :mod:`lightning_pipe.execution.sharding`) counts
    the squares of every replica's shard, gathered over ``shards`` and added in rank order. With tensor parallelism
    ``shards`` is every rank holding a part of the stage (replicas x tensor-parallel ranks) and each DTensor's
    squares count once per distinct slice (:func:`_split_squared_norm`).

    Every rank clips by the same bits, so that the copies of a replicated parameter never drift apart: each rank's
    squared norm is gathered and the parts are added in rank order on every rank, and the replicated parameters'
    part comes from the group's first rank alone (summed in another order, or with another thread count, a rank's
    copy of it could differ in the last bit)."""
    params = [p for p in parameters if p.grad is not None]
    held = {id(p) for p in params}
    replicated_ids = {id(p) for p in replicated}
    elsewhere_ids = {id(p) for p in counted_elsewhere}
    own = [p.grad for p in params if id(p) not in replicated_ids and id(p) not in elsewhere_ids]
    sharded = [g for g in own if isinstance(g, DTensor)]  # FSDP hook: this rank holds a shard of each
    part = _squared_norm([g for g in own if not isinstance(g, DTensor)], device)
    if shards is not None:
        part = part + _sum_over(_split_squared_norm(sharded, device, dist.get_world_size(shards)), shards, watchdog,
                                "the sharded gradients' norm")
    ranks = dist.get_process_group_ranks(group) if dist.get_world_size(group) > 1 else [dist.get_rank()]
    if dist.get_rank() == min(ranks):
        part = part + _squared_norm([p.grad for p in replicated if id(p) in held], device)
    total_norm = _sum_over(part, group, watchdog, "the gradient norm over the pipeline") if len(ranks) > 1 else part
    total_norm = total_norm.sqrt()
    torch.nn.utils.clip_grads_with_norm_([p for p in params if not isinstance(p.grad, DTensor)], clip_val, total_norm)
    if shards is not None:  # the coefficient clip_grads_with_norm_ applies, on each rank's shards
        scale_sharded_gradients([p for p in params if isinstance(p.grad, DTensor)],
                                (clip_val / (total_norm + 1e-6)).clamp(max=1.0))


def _split_squared_norm(grads: list[Tensor], device: torch.device, holders: int) -> Tensor:
    """This rank's share of the squared norm of ``grads`` (DTensors, each split or sharded over some of the
    ``holders`` ranks of a stage): its local part's squares times the count of distinct parts over ``holders``, so that
    the sum over the holders counts each part once (a part held alike by several ranks, as a row-wise layer's bias on
    every tensor-parallel rank or a split weight on every replica, is divided among them)."""
    by_share: dict[float, list[Tensor]] = {}
    for g in grads:
        distinct = 1
        for size, placement in zip(g.device_mesh.shape, g.placements):
            distinct *= 1 if placement.is_replicate() else size  # FSDP2 over a split one: a _StridedShard
        by_share.setdefault(distinct / holders, []).append(g)
    part = torch.zeros((), device=device, dtype=torch.float64)
    for share, same in by_share.items():
        part = part + local_squared_norm(same, device) * share
    return part


def _sum_over(part: Tensor, group: dist.ProcessGroup, watchdog: StallWatchdog, what: str) -> Tensor:
    """Every rank's ``part`` gathered over ``group`` and added in rank order: the same bits on every rank."""
    parts = [torch.empty_like(part) for _ in range(dist.get_world_size(group))]
    work = dist.all_gather(parts, part, group=group, async_op=True)
    watchdog.wait([work], watchdog.collective(what, group), group)
    return torch.stack(parts).sum()


def _squared_norm(tensors: list[Tensor], device: torch.device) -> Tensor:
    """The squared 2-norm of ``tensors`` seen as one vector (zero for none), on ``device``, in float64: the same dtype
    on every rank, whatever its gradients' dtypes."""
    if not tensors:
        return torch.zeros((), device=device, dtype=torch.float64)
    return torch.nn.utils.get_total_norm(tensors).to(device, torch.float64).square()


def agree_on_gradient_overflow(
    scaler: torch.amp.GradScaler, group: dist.ProcessGroup, device: torch.device, watchdog: StallWatchdog = UNWATCHED
) -> None:
    """With a gradient scaler (``16-mixed``), an inf on one stage must skip the step on every stage, and every
    stage's scale must change alike: share the overflow flag over the pipeline's ``group`` right after each stage
    unscales its gradients."""
    if "unscale_" in scaler.__dict__:
        return
    unscale = scaler.unscale_

    def unscale_and_agree(optimizer: Optimizer) -> None:
        unscale(optimizer)
        if not scaler.is_enabled():  # a disabled scaler unscales nothing and skips no step
            return
        found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        flag = torch.zeros((), device=device)
        for value in found.values():
            flag = torch.maximum(flag, value.to(flag.device))
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True)
        watchdog.wait([work], watchdog.collective("the gradient scaler's overflow check", group), group)
        for value in found.values():
            value.copy_(flag)

    scaler.unscale_ = unscale_and_agree  # type: ignore[method-assign]


def stop_agreeing_on_gradient_overflow(scaler: torch.amp.GradScaler) -> None:
    """Undo :func:`agree_on_gradient_overflow`: the scaler lets go of the pipeline's group, which must be freed before
    the process exits (a Trainer kept alive to the end, by Lightning 2.4 for one, would otherwise keep it)."""
    installed = scaler.__dict__.get("unscale_")
    if getattr(installed, "__qualname__", "").startswith(f"{agree_on_gradient_overflow.__name__}.<locals>"):
        del scaler.__dict__["unscale_"]


class StageGradients:
    """This rank's gradients before the optimizer step, as the strategy's hooks need them: ``replicated`` parameters
    (held by every stage), ``tied`` ones (shared by blocks of several stages) and those of outside modules held by
    some stages (``ownership``) summed over the pipeline, every gradient averaged over replicas; clipping by the
    whole model's norm; a gradient scaler's overflow agreed by every stage.

    It also starts the replicas identical (:meth:`start_identical`), since its reductions keep them so, and, with
    ``data_parallel="shard"`` or ``"full_shard"``, shards the stage's blocks over them there and owns the sharding."""

    def __init__(
        self,
        groups: PipelineGroups,
        replicated: list[nn.Parameter],
        tied: TiedParameters,
        ownership: OutsideOwnership,
        stage: StageBlocks,
        data_parallel: DataParallelMode = "replicate",
        tensor_plan: BlockPlans | None = None,
    ) -> None:
        self.groups = groups
        self.replicated = replicated
        self.tied = tied
        self.ownership = ownership
        self.stage = stage
        self.data_parallel = data_parallel
        self.tensor_plan = tensor_plan
        self.sharding: StageSharding | None = None  # with data_parallel="shard": built by `start_identical`
        self.tensor_parallel: StageTensorParallel | None = None  # with tensor_parallel_size > 1: the same

    def start_identical(self, held_outside: list[tuple[str, nn.Module]], precision: str | None = None) -> None:
        """Start identical where training keeps things identical: the replicated parameters on every rank (from rank
        0), tied parameters, and each stage's parameters and buffers on its replicas (from replica 0), with those of
        ``held_outside`` (the outside modules this stage holds and some other does not, by name). Then, with
        ``data_parallel="shard"`` or ``"full_shard"``, the identical blocks and those modules are sharded over the
        replicas (FSDP2, in Lightning's ``precision``). A collective, once, on the model moved to its device."""
        groups, stage = self.groups, self.stage
        outside_tensors = [t for _, module in held_outside for t in [*module.parameters(), *module.buffers()]]
        with torch.no_grad():
            for tensor in self.replicated:
                dist.broadcast(tensor.data, src=0)
            self.tied.start_identical()
            self.ownership.start_identical()
            if groups.layout.num_replicas > 1:
                source = groups.layout.rank(groups.stage, 0, groups.tensor_index)
                for tensor in [*stage.parameters(), *stage.buffers(), *outside_tensors]:
                    dist.broadcast(tensor.data, src=source, group=groups.replicas)
        if self.tensor_plan is not None:  # TP hook: the stage's blocks split over its tensor-parallel ranks
            self.tensor_parallel = parallelize_stage(((i, stage.originals[i]) for i in stage.indices), self.tensor_plan,
                                                     groups.mesh["tensor_parallel"], groups.tensor_parallel)  # type: ignore[index, arg-type]
        if self.data_parallel != "replicate":  # FSDP hook: the replicas' identical blocks sharded now
            kept_whole = [*self.replicated, *self.tied.parameters, *self.ownership.parameters]
            blocks = [(stage.region.names[i], stage.originals[i]) for i in stage.indices]
            # With split blocks, FSDP2 shards over the replicas' dimension of the run's mesh, beside the split's.
            mesh = groups.mesh["data_parallel"] if self.tensor_plan is not None else None  # type: ignore[index]
            self.sharding = shard_stage(blocks, self.data_parallel, groups.replicas, groups.device, kept_whole,
                                        groups.watchdog, held_outside, precision, mesh)

    def chunk_backward_done(self, chunk: int) -> None:
        """The engine ended chunk ``chunk``'s backward of one micro-batch (both halves, when split): under
        ``"full_shard"`` its blocks' gradients are reduce-scattered now (see :meth:`StageSharding.micro_batch_done`)."""
        if self.sharding is not None:
            self.sharding.micro_batch_done(self.stage.originals[i] for i in self.stage.chunk_ranges[chunk])


    def reduce(self, module: nn.Module) -> None:
        """Sum the replicated parameters' gradients over the pipeline, then average every gradient over replicas."""
        groups = self.groups
        reduce_gradients(self.replicated, groups.pipeline, average=False, watchdog=groups.watchdog)
        self.tied.sum_gradients()
        self.ownership.sum_gradients(groups.watchdog)
        if self.sharding is not None:  # FSDP hook: the sharded blocks' gradients reduce-scattered, averaged
            self.sharding.reduce_scatter_gradients()
        if groups.layout.num_replicas > 1:
            sharded = self.sharding.is_sharded if self.sharding is not None else lambda p: False
            trainable = [p for p in module.parameters() if p.requires_grad and not sharded(p)]
            reduce_gradients(trainable, groups.replicas, average=True, watchdog=groups.watchdog)

    def clip_grad_by_norm(self, precision: Any, optimizer: Optimizer, clip_val: float) -> None:
        """``clip_grad_norm_`` of ``optimizer``'s parameters (as ``precision`` holds them) by the whole model's norm,
        every stage's share counted (see :func:`clip_grad_norm_over_pipeline`): the precision's ``clip_grad_by_norm``."""
        groups = self.groups
        clip_grad_norm_over_pipeline(
            precision.main_params(optimizer), self.replicated, clip_val, groups.pipeline, groups.device,
            [*self.tied.counted_elsewhere, *self.ownership.counted_elsewhere], groups.watchdog,
            shards=groups.stage_holders if self.sharding is not None or self.tensor_parallel is not None else None,
        )

    def agree_on_overflow(self, precision: Any) -> None:
        """With a gradient scaler (16-mixed), an overflow on one stage skips the step on every stage."""
        scaler = getattr(precision, "scaler", None)
        if scaler is not None and self.sharding is not None:  # FSDP hook
            raise NotImplementedError(scaler_refused(self.sharding.mode))
        name = getattr(precision, "precision", "32-true")
        if self.tensor_parallel is not None and name not in ("32-true", "32", 32, "64-true"):  # TP hook
            raise NotImplementedError(
                f"precision={name!r} with tensor_parallel_size > 1 is not supported yet: blocks split with tensor"
                " parallelism have been shown to train as on one device in full precision only. Use"
                f" precision='32-true', or tensor_parallel_size=1 with {name!r}."
            )
        if scaler is not None and self.groups.num_stages > 1:
            agree_on_gradient_overflow(scaler, self.groups.pipeline, self.groups.device, self.groups.watchdog)
