"""One checkpoint for the whole model: merging the stages' optimizer states by parameter name, and splitting back.

Each stage's optimizer numbers only its own parameters. A consolidated state numbers every parameter of the whole
model as one device would: group by group, in the model's parameter order. That is the layout a single-device
``optimizer.load_state_dict`` expects, so the checkpoint loads on one device, or on any other stage count, by
looking each parameter up by name.

``lightning-pipe consolidate_checkpoint SHARDED_DIR OUT.ckpt`` writes a sharded checkpoint as one such
file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from lightning_pipe.execution.tied import ONE_DEVICE_NAME

OptimizerStateDict = dict[str, Any]  # torch's format: {"state": {index: {...}}, "param_groups": [{"params": [...]}]}


@dataclass
class NamedOptimizerState:
    """One stage's optimizer state, keyed by parameter name instead of position."""

    groups: list[dict[str, Any]]  # each group's hyper-parameters, with "params" holding parameter names
    state: dict[str, dict[str, Any]]  # per-parameter state (momentum buffers, ...) by name


def parameter_names(module: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` for every parameter of ``module``: its name on one device (a stage's copy of a
    parameter that an earlier stage also holds carries that name, see :mod:`lightning_pipe.execution.tied`)."""
    return {id(parameter): getattr(parameter, ONE_DEVICE_NAME, name) for name, parameter in module.named_parameters()}


def name_optimizer_state(state_dict: OptimizerStateDict, group_names: list[list[str]]) -> NamedOptimizerState:
    """Key a local optimizer state dict by parameter name; ``group_names`` lists each group's names in order."""
    index_to_name = {}
    groups = []
    for group, names in zip(state_dict["param_groups"], group_names):
        index_to_name.update(zip(group["params"], names))
        groups.append({**group, "params": list(names)})
    state = {index_to_name[index]: value for index, value in state_dict["state"].items()}
    return NamedOptimizerState(groups, state)


def global_group_names(local: list[list[list[str]]], model_order: list[str]) -> list[list[str]]:
    """Each group's parameter names over all stages, in the whole model's order (``local[stage][group]``).

    A replicated parameter appears on several stages and is listed once.
    """
    position = {name: i for i, name in enumerate(model_order)}
    num_groups = len(local[0])
    if any(len(stage_groups) != num_groups for stage_groups in local):
        raise ValueError(
            f"the stages' optimizers have different numbers of parameter groups ({[len(g) for g in local]});"
            " configure_optimizers must build the same groups on every stage (filter parameters by name or type,"
            " not by position)."
        )
    merged = []
    for g in range(num_groups):
        names = {name for stage_groups in local for name in stage_groups[g]}
        merged.append(sorted(names, key=position.__getitem__))
    return merged


def merge_optimizer_states(stages: list[NamedOptimizerState], model_order: list[str]) -> OptimizerStateDict:
    """The single-device optimizer state dict of the whole model, from every stage's named state."""
    groups = global_group_names([[group["params"] for group in stage.groups] for stage in stages], model_order)
    state_by_name: dict[str, dict[str, Any]] = {}
    for stage in stages:
        for name, value in stage.state.items():
            state_by_name.setdefault(name, value)  # replicated parameters: identical on every stage
    param_groups, state, index = [], {}, 0
    for names, hyper in zip(groups, stages[0].groups):
        indices = list(range(index, index + len(names)))
        param_groups.append({**hyper, "params": indices})
        state.update({i: state_by_name[name] for i, name in zip(indices, names) if name in state_by_name})
        index += len(names)
    return {"state": state, "param_groups": param_groups}


def split_optimizer_state(
    consolidated: OptimizerStateDict, groups: list[list[str]], local_group_names: list[list[str]]
) -> OptimizerStateDict:
    """This stage's share of a consolidated state dict, numbered as the local optimizer numbers its parameters.

    ``groups`` are the global group names (see :func:`global_group_names`) that the consolidated numbering follows.
    """
    if len(consolidated["param_groups"]) != len(groups):
        raise ValueError(
            f"the checkpoint's optimizer has {len(consolidated['param_groups'])} parameter groups but this model's"
            f" has {len(groups)}; load it with the configure_optimizers that saved it."
        )
    global_index: dict[str, int] = {}
    for saved_group, names in zip(consolidated["param_groups"], groups):
        if len(saved_group["params"]) != len(names):
            raise ValueError(
                f"a parameter group of the checkpoint's optimizer holds {len(saved_group['params'])} parameters but"
                f" the model's holds {len(names)}; the checkpoint belongs to a different model."
            )
        global_index.update(zip(names, saved_group["params"]))
    param_groups, state, index = [], {}, 0
    for saved_group, names in zip(consolidated["param_groups"], local_group_names):
        indices = list(range(index, index + len(names)))
        param_groups.append({**saved_group, "params": indices})
        for i, name in zip(indices, names):
            if global_index[name] in consolidated["state"]:
                state[i] = consolidated["state"][global_index[name]]
        index += len(names)
    return {"state": state, "param_groups": param_groups}

