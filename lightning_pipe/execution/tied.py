"""Parameters shared between stages: which they are, and keeping every copy identical, as one device's one tensor.

A parameter can be used by more than one place of a model (tied weights: ``net[4].weight = net[0].weight``). Split
into stages, each process holds its own copy. Two kinds:

* used by blocks of several stages (:class:`TiedParameter`): each stage that holds it computes part of its
  gradient. Those stages start from the same values, sum their gradients over a group of just those stages, and
  apply the same update, as DeepSpeed's ``TiedLayerSpec`` does. Gradient clipping counts it once, and checkpoints
  name every copy's optimizer state by the parameter's name on one device.
* used by a block and by a module outside the pipelined one (an embedding tied to a head that runs on every
  stage): every stage holds it, so it is one of the replicated parameters (:func:`replicated_parameters`), whose
  gradients are summed over the whole pipeline.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from lightning_pipe.execution.gradients import reduce_gradients
from lightning_pipe.execution.stage import StageBlocks
from lightning_pipe.partition.topology import PipelineLayout

# The attribute under which a stage's copy of a parameter shared with an earlier stage holds its one-device name.
ONE_DEVICE_NAME = "_lightning_pipe_one_device_name"


@dataclass(frozen=True)
class TiedParameter:
    """A parameter of the pipelined module used by blocks of several stages.

    ``stages`` are ordered by their first use of it along the model (with several chunks per stage, not the stage
    order), and ``places`` holds, for each, the block index and the parameter's name within that block of that use
    (``(4, "weight")``): where the stage finds its copy. The first place is the parameter's name on one device.
    ``last_user`` is the stage of its last use, which on one device initialises it last.
    """

    stages: tuple[int, ...]
    places: tuple[tuple[int, str], ...]
    last_user: int


def parameters_shared_across_stages(
    blocks: Sequence[nn.Module], held: Sequence[Sequence[int]]
) -> list[TiedParameter]:
    """The parameters that blocks of more than one stage use (``held``: each stage's block indices), in the order of
    their first use."""
    uses: dict[int, list[tuple[int, str, int]]] = {}  # parameter id -> (block index, name, stage) of every use
    for stage, indices in enumerate(held):
        for index in indices:
            for local_name, parameter in blocks[index].named_parameters(remove_duplicate=False):
                uses.setdefault(id(parameter), []).append((index, local_name, stage))
    tied = []
    for found in uses.values():
        found.sort(key=lambda use: use[0])  # along the model (stable: a block's own order within it)
        first: dict[int, tuple[int, str]] = {}  # stage -> its first use
        for index, local_name, stage in found:
            first.setdefault(stage, (index, local_name))
        if len(first) > 1:
            tied.append(TiedParameter(tuple(first), tuple(first.values()), last_user=found[-1][2]))
    return sorted(tied, key=lambda tie: tie.places[0])


def replicated_parameters(module: nn.Module, block_names: Sequence[str]) -> list[nn.Parameter]:
    """The parameters that every stage holds: those of the modules outside the pipelined blocks (including one tied
    to a pipelined block), in the order of their names, which is the same on every rank."""
    inside = tuple(f"{name}." for name in block_names)
    seen: set[int] = set()
    replicated = []
    for name, parameter in module.named_parameters(remove_duplicate=False):
        if not name.startswith(inside) and id(parameter) not in seen:
            seen.add(id(parameter))
            replicated.append(parameter)
    return replicated


class TiedParameters:
    """This rank's copies of the parameters shared with other stages, with the groups of the stages holding them.

    Built on every rank (creating process groups is collective), after the stage is materialised.
    """

    def __init__(
        self,
        tied: list[TiedParameter],
        stage: StageBlocks,
        layout: PipelineLayout,
        replicated: list[nn.Parameter],
        timeout: timedelta | None,
    ) -> None:
        stage_index = stage.stage_index
        replicated_ids = {id(p) for p in replicated}
        self._held: list[tuple[nn.Parameter, dist.ProcessGroup, int]] = []  # copy, its group, the group's source
        self._counted_elsewhere: list[nn.Parameter] = []
        groups: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        for tie in tied:
            if tie.stages not in groups:  # one group per set of stages, in the same order on every rank
                rank_sets = [[layout.rank(s, *pipeline) for s in tie.stages] for pipeline in layout.pipelines()]
                groups[tie.stages], _ = dist.new_subgroups_by_enumeration(rank_sets, timeout=timeout)
            if stage_index not in tie.stages:
                continue
            index, local_name = tie.places[tie.stages.index(stage_index)]
            parameter = stage.originals[index].get_parameter(local_name)
            if id(parameter) in replicated_ids:
                continue  # also used outside the pipelined module: summed over the whole pipeline already
            group = groups[tie.stages]
            assert group is not None
            # The last user's values: on one device, the last module holding a tied parameter initialises it last
            # (see `materialize.init_weights`); a model built whole has the same values on every stage anyway.
            source = layout.rank(tie.last_user, layout.replica(dist.get_rank()), layout.tensor_index(dist.get_rank()))
            self._held.append((parameter, group, source))
            if stage_index != tie.stages[0]:
                self._counted_elsewhere.append(parameter)
                # Checkpoints name optimizer state by parameter: this copy goes by the name one device gives it.
                first_index, first_name = tie.places[0]
                setattr(parameter, ONE_DEVICE_NAME, f"{stage.region.names[first_index]}.{first_name}")

    @property
    def parameters(self) -> list[nn.Parameter]:
        """This rank's copies: kept whole on every replica (never sharded), their gradients summed over holders."""
        return [parameter for parameter, _, _ in self._held]

    @property
    def counted_elsewhere(self) -> list[nn.Parameter]:
        """Copies whose gradient another stage counts in the model's gradient norm (the first stage holding each)."""
        return self._counted_elsewhere

    def start_identical(self) -> None:
        """Every copy takes the values of the last holding stage's copy, as the one tensor of one device."""
        with torch.no_grad():
            for parameter, group, source in self._held:
                dist.broadcast(parameter.data, src=source, group=group)

    def sum_gradients(self) -> None:
        """Each copy's gradient becomes the sum over the stages that hold it: the gradient one device computes."""
        by_group: dict[int, tuple[dist.ProcessGroup, list[nn.Parameter]]] = {}
        for parameter, group, _ in self._held:
            by_group.setdefault(id(group), (group, []))[1].append(parameter)
        for group, parameters in by_group.values():
            reduce_gradients(parameters, group, average=False)
