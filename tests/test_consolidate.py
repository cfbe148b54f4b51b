"""Optimizer states of the stages merge into the single-device layout and split back by parameter name."""

import pytest
import torch
from torch import nn

from lightning_pipe.checkpoints.optimizer_states import (
    global_group_names,
    merge_optimizer_states,
    name_optimizer_state,
    split_optimizer_state,
)


def stepped_optimizer():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=0.1)
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    names = [n for n, _ in model.named_parameters()]
    return optimizer.state_dict(), names


def test_split_then_merge_gives_back_the_single_device_state():
    full, order = stepped_optimizer()
    groups = [[n for n in order if n.endswith("weight")], [n for n in order if n.endswith("bias")]]
    # two stages: layers 0-1 and layer 2; nothing replicated
    stage_groups = [[[n for n in g if not n.startswith("2.")] for g in groups], [[n for n in g if n.startswith("2.")] for g in groups]]
    assert global_group_names(stage_groups, order) == groups
    shares = [split_optimizer_state(full, groups, local) for local in stage_groups]
    named = [name_optimizer_state(share, local) for share, local in zip(shares, stage_groups)]
    merged = merge_optimizer_states(named, order)
    assert merged["param_groups"] == full["param_groups"]
    assert merged["state"].keys() == full["state"].keys()
    for index, state in full["state"].items():
        for key, value in state.items():
            assert torch.equal(merged["state"][index][key], value)


def test_replicated_parameters_are_listed_once():
    order = ["embed", "a", "b", "head"]
    stages = [[["embed", "a", "head"]], [["embed", "b", "head"]]]
    assert global_group_names(stages, order) == [["embed", "a", "b", "head"]]


def test_different_group_counts_name_the_fix():
    with pytest.raises(ValueError, match="same groups on every stage"):
        global_group_names([[["a"]], [["b"], ["c"]]], ["a", "b", "c"])


def test_a_checkpoint_of_another_model_is_refused():
    full, order = stepped_optimizer()
    with pytest.raises(ValueError, match="belongs to a different model"):
        split_optimizer_state(full, [order[:2], order[2:]], [order[:1], []])
