"""The modules outside the pipelined blocks, held by the stages that run them (see
:mod:`lightning_pipe.partition.placement`): the embeddings by the first stage, the head by the loss stage.

On a stage that does not hold one, an :class:`AbsentModule` stands in its place: no parameters, no gradient, no
optimizer state. Its call answers zeros shaped as the module's output (computed on the meta device), needing a
gradient where that output would: on that stage nothing reads the values, only the shapes (and whether a gradient
is needed, which the model's reentrant checkpoints read) flow on to blocks that run elsewhere. What a parameter's holders do
together (:class:`OutsideOwnership`): start from the same values, sum their gradients, count them once in the
gradient norm. A parameter held by every stage stays one of the pipeline's replicated parameters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn

from lightning_pipe.execution.call_order import map_tensors
from lightning_pipe.execution.gradients import reduce_gradients
from lightning_pipe.execution.materialize import holds_meta_tensors
from lightning_pipe.execution.placeholders import SIGNATURES_KEPT, needing_gradients_as_real, signature
from lightning_pipe.execution.process_groups import PipelineGroups, broadcast_object
from lightning_pipe.execution.stage import StandIn, replace_submodule
from lightning_pipe.partition.hooks import hooks_set_aside
from lightning_pipe.partition.placement import EVERY, OutsidePlaces, observe_places, outside_modules, unobserved_note
from lightning_pipe.partition.region import Region
from lightning_pipe.partition.step_probe import fit_training_step, random_state_kept
from lightning_pipe.partition.topology import PipelineLayout
from lightning_pipe.reliability.watchdog import UNWATCHED, StallWatchdog


class AbsentModule(StandIn):
    """Stands where an outside module that other stages hold was (``where``: which, in words). A call answers zeros
    with the shapes and dtypes of the module's output, on ``device``: computed on the meta device once per input
    signature (it is called once per micro-batch under the per-micro-batch schedules), needing a gradient where the
    module's output would (see :func:`~lightning_pipe.execution.placeholders.needing_gradients_as_real`)."""

    _own_attributes = ("_original", "_meta_state", "_outputs")

    def __init__(self, name: str, original: nn.Module, where: str, device: torch.device) -> None:
        super().__init__()
        self.module_name = name
        self.where = where
        self.device = device
        object.__setattr__(self, "_original", original)
        # The original's tensors as meta tensors, following the dtype casts the model gets (`.to(torch.bfloat16)`).
        state = {**dict(original.named_parameters()), **dict(original.named_buffers())}
        object.__setattr__(self, "_meta_state", {k: torch.empty_like(t, device="meta") for k, t in state.items()})
        object.__setattr__(self, "_outputs", {})  # input signature -> the meta output

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = signature((self._original.training, args, kwargs))
        output = self._outputs.get(key) if key is not None else None
        if output is None:
            with torch.no_grad(), hooks_set_aside(self._original.modules()):
                output = torch.func.functional_call(
                    self._original, self._meta_state, map_tensors(args, _to_meta), map_tensors(kwargs, _to_meta),
                    strict=False,
                )
            if key is not None:
                if len(self._outputs) >= SIGNATURES_KEPT:
                    self._outputs.clear()  # signatures that change every step (a growing sequence) must not pile up
                self._outputs[key] = output
        zeros = map_tensors(output, lambda t: torch.zeros(t.shape, dtype=t.dtype, device=self.device))
        return needing_gradients_as_real(zeros, self._original, args, kwargs)

    forward = __call__

    def _apply(self, fn: Any, recurse: bool = True) -> AbsentModule:
        """A cast of the model (its dtype, its device) reaches the meta state's dtypes and the answers' device."""
        probe = fn(torch.empty(0, device=self.device))
        self.device = probe.device
        self._outputs.clear()
        for key, tensor in self._meta_state.items():
            if tensor.is_floating_point():
                cast = fn(torch.empty(0, dtype=tensor.dtype, device=self.device))
                self._meta_state[key] = torch.empty_like(tensor, dtype=cast.dtype)
        return self

    def _held_elsewhere(self, name: str) -> str:
        return f"{self.module_name}.{name} is held by {self.where}, not this stage"

    def extra_repr(self) -> str:
        return f"{self.module_name}, held by {self.where}"


class OutsideModules:
    """The outside modules this stage does not hold, each replaced by an :class:`AbsentModule` in ``model``."""

    def __init__(self, model: nn.Module, absent: Mapping[str, str], device: torch.device) -> None:
        self.model = model
        self.originals = {name: model.get_submodule(name) for name in absent}
        self.stand_ins = {
            name: AbsentModule(name, original, absent[name], device) for name, original in self.originals.items()
        }

    def install(self) -> None:
        for name, stand_in in self.stand_ins.items():
            replace_submodule(self.model, name, stand_in)

    def uninstall(self) -> None:
        for name, original in self.originals.items():
            replace_submodule(self.model, name, original)

    @contextlib.contextmanager
    def showing_whole_model(self) -> Iterator[None]:
        """While open, the model holds every outside module again (Lightning's model summary reads them)."""
        self.uninstall()
        try:
            yield
        finally:
            self.install()


class OutsideOwnership:
    """This rank's share of the parameters held by some stages but not all (an embedding tied to the head: the first
    and the loss stage): one value, the gradients summed over their holders, counted once in the norm.

    ``holders`` maps each such parameter's name (its first name in the whole model) to its holding stages, and
    ``source`` to the stage whose value they all start from (the one whose module initialises it last on one
    device). Built on every rank: creating the holders' process groups is collective.
    """

    def __init__(
        self,
        model: nn.Module,
        holders: Mapping[str, Sequence[int]],
        source: Mapping[str, int],
        aliases: Mapping[str, Sequence[str]],
        stage: int,
        layout: PipelineLayout,
        timeout: timedelta | None,
    ) -> None:
        local = dict(model.named_parameters(remove_duplicate=False))
        replica = layout.replica(dist.get_rank())
        self._held: list[tuple[nn.Parameter, dist.ProcessGroup, int]] = []  # parameter, its holders' group, source
        self.counted_elsewhere: list[nn.Parameter] = []
        groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        for name, stages in holders.items():
            key = tuple(sorted(stages))
            if key not in groups:  # one group per set of stages, created in the same order on every rank
                rank_sets = [[layout.rank(s, r) for s in key] for r in range(layout.num_replicas)]
                groups[key], _ = dist.new_subgroups_by_enumeration(rank_sets, timeout=timeout)
            if stage not in key:
                continue
            parameter = next(local[alias] for alias in aliases[name] if alias in local)
            self._held.append((parameter, groups[key], layout.rank(source[name], replica)))  # type: ignore[arg-type]
            if stage != key[0]:
                self.counted_elsewhere.append(parameter)

    @property
    def parameters(self) -> list[nn.Parameter]:
        """This rank's copies: kept whole on every replica (never sharded), their gradients summed over holders."""
        return [parameter for parameter, _, _ in self._held]

    def start_identical(self) -> None:
        with torch.no_grad():
            for parameter, group, source in self._held:
                dist.broadcast(parameter.data, src=source, group=group)

    def sum_gradients(self, watchdog: StallWatchdog = UNWATCHED) -> None:
        by_group: dict[int, tuple[dist.ProcessGroup, list[nn.Parameter]]] = {}
        for parameter, group, _ in self._held:
            by_group.setdefault(id(group), (group, []))[1].append(parameter)
        for group, parameters in by_group.values():
            reduce_gradients(parameters, group, average=False, watchdog=watchdog)


def _to_meta(tensor: Tensor) -> Tensor:
    return tensor if tensor.is_meta else torch.empty_like(tensor, device="meta")


# ---- deciding at set-up ----------------------------------------------------------------------------------------

# Where the modules outside the blocks were placed in this model's last run (see `decide_outside_places`).
_OUTSIDE_PLACES = "_lightning_pipe_outside_places"


def decide_outside_places(module: LightningModule, region: Region, groups: PipelineGroups) -> OutsidePlaces:
    """Where each module outside the blocks runs (see :mod:`lightning_pipe.partition.placement`), observed on global
    rank 0 in the training step on the first batch's shapes and broadcast; on every stage when there is no training
    step to observe (validate, test, predict) or the step cannot run on the meta device."""
    names = outside_modules(module, region)
    # A later run of the same model (validate, test or predict after fit) keeps the places the fit observed: a model
    # built on the meta device stays distributed after fit, each module where it was trained.
    earlier = module.__dict__.get(_OUTSIDE_PLACES)
    places = earlier if earlier is not None and set(earlier.places) == set(names) else OutsidePlaces(
        {name: frozenset({EVERY}) for name in names}
    )
    if groups.rank == 0 and groups.num_stages > 1:
        places = _observed_places(module, region, names) or places
        note = unobserved_note(places, module, region)
        if note is not None:
            rank_zero_warn(note)
    places = broadcast_object(places, 0, groups.rank, groups.watchdog)
    module.__dict__[_OUTSIDE_PLACES] = places
    return places


def outside_module_stages(places: OutsidePlaces, held: list[list[int]], groups: PipelineGroups) -> dict[str, frozenset[int]]:
    """The stages holding each module outside the blocks, once each stage's blocks are known."""
    block_stage = {index: stage for stage, indices in enumerate(held) for index in indices}
    loss_stage, num_stages = groups.layout.loss_stage, groups.num_stages
    return {name: places.stages(name, block_stage.__getitem__, loss_stage, num_stages) for name in places.places}


def _observed_places(module: LightningModule, region: Region, names: list[str]) -> OutsidePlaces | None:
    step = fit_training_step(module)
    if step is None:
        return None
    try:
        with random_state_kept():
            return observe_places(module, region, step, names)
    except Exception as error:  # an unusual step: every stage holds every module, as the model was built
        return OutsidePlaces({name: frozenset({EVERY}) for name in names}, unobserved=f"{type(error).__name__}: {error}")


def built_real_everywhere(module: LightningModule, names: list[str], groups: PipelineGroups) -> dict[str, bool]:
    """Whether each outside module was built with real tensors on every rank (not on the meta device, nor left there
    by an earlier run that trained it elsewhere): decided over the world, so that every rank agrees."""
    flags = torch.tensor([int(not holds_meta_tensors(module.get_submodule(name))) for name in names] or [1],
                         device=groups.device)
    if dist.get_world_size() > 1:
        work = dist.all_reduce(flags, op=dist.ReduceOp.MIN, async_op=True)
        groups.watchdog.wait([work], groups.watchdog.collective("a decision of every rank", dist.group.WORLD),
                             dist.group.WORLD)
    return {name: bool(flag) for name, flag in zip(names, flags.tolist())}
