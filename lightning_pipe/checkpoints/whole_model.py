"""The whole model from its stages: gathered for a consolidated checkpoint, split back when one loads, and put back
together in the user's module after a run.

A consolidated checkpoint holds the whole model, numbered as on one device, so it loads anywhere: the loss stage of
a pipeline (global rank 0 in the first) gathers every stage's weights and optimizer state and Lightning writes them.
On load, each rank copies out only its stage's share (:mod:`lightning_pipe.checkpoints.optimizer_states` does the renumbering). After
a run, the user's ``nn.Sequential`` goes back into the LightningModule: whole on every rank for a model built the
usual way; for a model built on the meta device, each rank keeps its own trained stage (and the rest on the meta
device) unless the whole model was asked for. Either way the optimizers stay per stage, so a checkpoint written
after the run gathers them as during it. ``stage_ranks`` is always this rank's pipeline, by stage; its loss stage
(the last one, or the first for a V-shaped schedule such as ``zbv``) holds the lowest of them (see
:mod:`lightning_pipe.partition.topology`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch import LightningModule
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_pipe.checkpoints.optimizer_states import (
    global_group_names,
    merge_optimizer_states,
    name_optimizer_state,
    parameter_names,
    split_optimizer_state,
)
from lightning_pipe.execution.materialize import mark_held_elsewhere


@dataclass
class WholeModelLayout:
    """The whole model as the user built it: its blocks, which stage holds which, its keys in order, and how to put
    the blocks back after the run."""

    name: str
    sequential: nn.Sequential
    ranges: list[list[int]]  # the blocks each stage holds (with virtual stages, several chunks' worth)
    state_keys: list[str]  # the whole model's state-dict keys, in order
    parameter_order: list[str]  # the whole model's parameter names, in order
    put_back: Callable[[], None]  # puts every block back where the model had it
    # After a run of a model built the usual way, every rank holds the whole trained model: nothing to gather.
    whole_on_every_rank: bool = False
    block_names: tuple[str, ...] = ()  # each block's qualified name in the LightningModule, in order
    # The modules outside the blocks that some stages hold and others not: the module as built, its holding stages,
    # and whether it was built with real tensors (not on the meta device) on every rank.
    outside: dict[str, tuple[nn.Module, tuple[int, ...], bool]] = field(default_factory=dict)

    # Keys whose tensor is an earlier key's on one device (a tied head, a layer sharing another's weight): written
    # once, under the earlier name, as `save_pretrained` writes them (see `tied_aliases`).
    aliases: frozenset[str] = frozenset()

    def holders(self, key: str) -> list[int]:
        """The stages whose ranks hold ``key``'s tensor: the stage of its block; for a key outside the pipelined
        blocks, the stages holding its module (the embeddings the first, the head the last), else every stage."""
        for index, name in enumerate(self.block_names):
            if key.startswith(f"{name}."):
                return [stage for stage, held in enumerate(self.ranges) if index in held]
        for name, (_, stages, _) in self.outside.items():
            if key.startswith(f"{name}."):
                return list(stages)
        return list(range(len(self.ranges)))

    def writer(self, key: str) -> int | None:
        """The one stage that writes ``key`` when each stage writes its own share: the first stage that holds it;
        None for an alias of an earlier key, which that key's writer writes once."""
        if key in self.aliases:
            return None
        return min(self.holders(key))

    def stage_keys(self, stage: int) -> list[str]:
        """The state-dict keys that stage ``stage`` writes (:meth:`writer`), in the whole model's order."""
        return [key for key in self.state_keys if self.writer(key) == stage]


def tied_aliases(module: nn.Module) -> frozenset[str]:
    """The keys of ``module``'s state dict whose tensor an earlier key already holds (``lm_head.weight`` tied to
    ``transformer.wte.weight``): read on the whole model before it is split, where every tie is one tensor."""
    seen: set[int] = set()
    aliases = set()
    for key, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            aliases.add(key)
        seen.add(id(tensor))
    return frozenset(aliases)


# ---- saving: the whole model on the loss stage -------------------------------------------------------------------


def whole_state_dict(
    module: LightningModule,
    pipelined: WholeModelLayout,
    stage_ranks: Sequence[int],
    rank: int,
    group: dist.ProcessGroup | None,
) -> dict[str, Any]:
    """The whole model's state dict on the loss stage (keys in the whole model's order); this rank's own weights
    elsewhere."""
    local = held_state_dict(module)
    if pipelined.whole_on_every_rank:
        return local
    stages = gather_to_loss_stage(_to_cpu(local), stage_ranks, rank, group)
    if stages is None:
        return local
    merged = {key: value for stage in stages for key, value in stage.items()}
    return {key: merged[key] for key in pipelined.state_keys if key in merged}


def held_state_dict(module: nn.Module) -> dict[str, Any]:
    """``module``'s state dict without the tensors left on the meta device (blocks another rank holds)."""
    return {key: value for key, value in module.state_dict().items() if not _is_meta(value)}


def whole_optimizer_state(
    optimizer: Optimizer,
    module: LightningModule,
    parameter_order: list[str],
    stage_ranks: Sequence[int],
    rank: int,
    group: dist.ProcessGroup | None,
) -> dict[str, Any]:
    """The whole model's optimizer state on the loss stage, numbered as a single-device optimizer's; this stage's
    elsewhere."""
    local = optimizer.state_dict()
    named = name_optimizer_state(_to_cpu(local), group_names(module, optimizer))
    stages = gather_to_loss_stage(named, stage_ranks, rank, group)
    if stages is None:
        return local
    return merge_optimizer_states(stages, parameter_order)


def group_names(module: LightningModule, optimizer: Optimizer) -> list[list[str]]:
    """The names (in ``module``) of each of ``optimizer``'s parameter groups' parameters."""
    names = parameter_names(module)
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def gather_to_loss_stage(
    obj: Any, stage_ranks: Sequence[int], rank: int, group: dist.ProcessGroup | None
) -> list[Any] | None:
    """Every stage's ``obj`` on the loss stage of this pipeline, the writer of checkpoints (in stage order); None
    elsewhere."""
    writer = _loss_stage_rank(stage_ranks)
    gathered: list[Any] | None = [None] * len(stage_ranks) if rank == writer else None
    dist.gather_object(obj, gathered, dst=writer, group=group)
    if gathered is None:
        return None
    by_rank = dict(zip(sorted(stage_ranks), gathered))  # gather_object orders by rank within the group
    return [by_rank[stage_rank] for stage_rank in stage_ranks]


def _loss_stage_rank(stage_ranks: Sequence[int]) -> int:
    """The rank of the pipeline's loss stage: its lowest (global rank 0 in the first pipeline, where Lightning writes
    checkpoints and the launching process runs)."""
    return min(stage_ranks)


def refuse_checkpoint_without_stages(after_spawned_ranks: bool, filepath: str | Path) -> None:
    """Raise: this process holds no stage of a pipeline (the launching process of the spawn and fork launchers,
    whose workers have ended, or a process whose run failed), so the stages' optimizer states are out of reach and
    a checkpoint would hold part of them."""
    if after_spawned_ranks:
        where = (
            "in the launching process of the spawn/fork launcher, after its worker processes ended: each stage's"
            " optimizer state ended with the worker that held it"
        )
    else:
        where = "after a run that failed (or before any run): the stages' optimizer states are out of reach"
    raise RuntimeError(
        f"trainer.save_checkpoint({str(filepath)!r}) cannot write a complete checkpoint {where}. Save checkpoints"
        " during the run (ModelCheckpoint, or trainer.save_checkpoint in a callback, on every rank), use the default"
        " start method (strategy='gpipe'), where every rank continues after fit and can save, or pass"
        " weights_only=True to save the model's weights alone."
    )


# ---- loading: each stage's share ---------------------------------------------------------------------------------


def load_stage_state_dict(
    module: LightningModule, saved: Mapping[str, Any], state_keys: list[str], strict: bool
) -> None:
    """Copy this rank's weights (its stage's and the replicated modules') out of the whole model's state dict
    ``saved``; with ``strict``, its keys must be the whole model's, ``state_keys``."""
    if strict:
        whole = set(state_keys)
        missing = [key for key in state_keys if key not in saved]
        unexpected = [key for key in saved if key not in whole]
        if missing or unexpected:
            raise RuntimeError(
                f"the checkpoint does not hold this model's weights: missing keys {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}, unexpected keys {unexpected[:5]}"
                f"{' ...' if len(unexpected) > 5 else ''}; load a checkpoint of this model, or set"
                " `model.strict_loading = False` to load the keys that match."
            )
    module.load_state_dict({key: saved[key] for key in module.state_dict() if key in saved}, strict=False)


def load_stage_optimizer_state(
    optimizer: Optimizer,
    saved: Mapping[str, Any],
    module: LightningModule,
    parameter_order: list[str],
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> None:
    """Load this stage's share of ``saved``, a consolidated optimizer state, into ``optimizer`` (a collective over
    the pipeline's ``group``: every stage says which parameters its optimizer holds)."""
    local_names = group_names(module, optimizer)
    every_stage: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every_stage, local_names, group=group)
    groups = global_group_names(every_stage, parameter_order)
    local_state = split_optimizer_state(saved, groups, local_names)
    # Copied out of the memory-mapped file: the optimizer would otherwise keep tensors backed by it.
    optimizer.load_state_dict(apply_to_collection(local_state, Tensor, torch.clone))
    _optimizers_to_device([optimizer], device)


# ---- after the run: the whole model back in the user's module ----------------------------------------------------


def restore_whole_model(
    module: LightningModule,
    pipelined: WholeModelLayout,
    stage_ranks: Sequence[int],
    rank: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
    deferred: bool,
    gather_deferred: bool,
) -> None:
    """Put the whole ``nn.Sequential`` back, every block holding its stage's trained weights, on every rank.

    The user's model object then holds the whole trained model after ``fit``, as on one device: for
    ``trainer.test(model)``, ``torch.save(model.state_dict())`` and the spawn launcher, which copies rank 0's
    weights into the launching process. A model built on the meta device (``deferred``) was built so because it
    need not fit on one host: each rank keeps its own stage, the other stages' blocks stay on the meta device; with
    ``gather_deferred`` the loss stage receives them (see :func:`_gather_whole_model_to_loss_stage`).
    """
    pieces = _pieces(pipelined)
    if deferred:
        # Outside modules built real on every rank (in __init__, beside a pipelined module built in configure_model)
        # come back trained everywhere, as they were held everywhere before the run.
        built_real = [(module, stages) for module, stages, real in pipelined.outside.values() if real]
        _broadcast_from_holders(built_real, stage_ranks, group, device)
        rest = [piece for piece in pieces if all(piece[0] is not module for module, _ in built_real)]
        if gather_deferred:
            _gather_whole_model_to_loss_stage(rest, stage_ranks, rank, group, device)
        else:
            mine = stage_ranks.index(rank)
            mark_held_elsewhere([module for module, stages in rest if mine not in stages])
        pipelined.put_back()
        return
    _broadcast_from_holders(pieces, stage_ranks, group, device)
    pipelined.put_back()
    pipelined.whole_on_every_rank = True


def _broadcast_from_holders(
    pieces: list[tuple[nn.Module, tuple[int, ...]]], stage_ranks: Sequence[int], group: dist.ProcessGroup | None,
    device: torch.device,
) -> None:
    """Every rank's copy of each piece takes the trained values of its first holding stage."""
    with torch.no_grad():
        for module, stages in pieces:
            for tensor in module.state_dict().values():
                buffer = tensor.to(device)
                dist.broadcast(buffer, src=stage_ranks[stages[0]], group=group)
                tensor.copy_(buffer)


def _pieces(pipelined: WholeModelLayout) -> list[tuple[nn.Module, tuple[int, ...]]]:
    """What some stage does not hold, in an order every rank agrees on: each block and each outside module held by
    some stages only, with the stages holding it."""
    layers = list(pipelined.sequential)
    blocks = [(layers[index], (stage,)) for stage, indices in enumerate(pipelined.ranges) for index in indices]
    return blocks + [(module, stages) for module, stages, _ in pipelined.outside.values()]


def _gather_whole_model_to_loss_stage(
    pieces: list[tuple[nn.Module, tuple[int, ...]]],
    stage_ranks: Sequence[int],
    rank: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> None:
    """After a run of a model built on the meta device: the loss stage (global rank 0 in the first pipeline)
    receives every other stage's trained blocks (and the outside modules it does not hold) into host memory, one
    ``pieces`` entry (a module, the stages holding it) at a time.

    The launching process then holds the whole trained model, as on one device (for ``torch.save``,
    ``trainer.test(model)`` and the spawn launcher), at the cost a consolidated checkpoint has anyway; the other
    ranks never hold more than their stage. There the other stages' blocks stay on the meta device, marked so
    that a later setup does not re-initialise them as new.
    """
    receiver = _loss_stage_rank(stage_ranks)
    elsewhere = []
    with torch.no_grad():
        for layer, stages in pieces:
            holders = [stage_ranks[stage] for stage in stages]
            owner = holders[0]
            if receiver in holders:
                if rank not in holders:
                    elsewhere.append(layer)
                continue
            if rank == receiver:
                layer.to_empty(device="cpu")
                for tensor in _own_tensors(layer):
                    on_device = device.type != "cpu"
                    buffer = torch.empty_like(tensor, device=device) if on_device else tensor
                    dist.recv(buffer, src=owner, group=group)
                    tensor.copy_(buffer)
            elif rank == owner:
                for tensor in _own_tensors(layer):
                    dist.send(tensor.to(device), dst=receiver, group=group)
            else:
                elsewhere.append(layer)
    mark_held_elsewhere(elsewhere)


def _own_tensors(module: nn.Module) -> list[Tensor]:
    """Every parameter and buffer of ``module`` (non-persistent buffers too), in an order all ranks agree on."""
    return [tensor.detach() for tensor in [*module.parameters(), *module.buffers()]]


def _is_meta(value: Any) -> bool:
    return isinstance(value, Tensor) and value.is_meta


def _to_cpu(value: Any) -> Any:
    return apply_to_collection(value, Tensor, lambda t: t.detach().to("cpu"))
