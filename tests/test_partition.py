"""Choosing the container (or chain of modules) to pipeline and splitting it by an explicit balance."""

import pytest
from torch import nn

from helpers.models import PipeClassifier
from lightning_pipe import PipelineParallelConfig
from lightning_pipe.partition.balance import stage_ranges
from lightning_pipe.partition.region import find_region


def test_default_is_the_outermost_sequential_with_most_parameters():
    model = PipeClassifier()
    model.small = nn.Sequential(nn.Linear(2, 2))
    region = find_region(model)
    assert region.label == "net.model" and region.blocks(model) == list(model.net.model)


def test_sequentials_nested_in_a_sequential_are_not_candidates():
    model = nn.Module()
    model.outer = nn.Sequential(nn.Sequential(nn.Linear(100, 100)), nn.Linear(1, 1))
    model.other = nn.Sequential(nn.Linear(50, 50))
    assert find_region(model).label == "outer"


def test_module_name_selects_a_nested_sequential():
    model = PipeClassifier()
    assert find_region(model, "net.model").blocks(model) == list(model.net.model)


def test_module_name_that_is_not_a_sequential_says_so():
    with pytest.raises(TypeError, match="'net' names a Component, not an nn.Sequential or nn.ModuleList"):
        find_region(PipeClassifier(), "net")


def test_missing_module_name_lists_the_sequentials():
    with pytest.raises(ValueError, match=r"'net.body' does not exist.*\['net.model'\]"):
        find_region(PipeClassifier(), "net.body")


def test_model_without_sequential_names_the_fix():
    model = nn.Module()
    model.layer = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="contains no nn.Sequential or nn.ModuleList to pipeline"):
        find_region(model)


def test_balance_gives_layers_per_stage():
    assert stage_ranges(PipelineParallelConfig(2, 4), 8, [3, 5]) == [range(0, 3), range(3, 8)]


@pytest.mark.parametrize(
    ("balance", "message"),
    [([3, 4], "sums to 7 but the pipelined module has 8 blocks"), ([8], "has 1 entries but there are 2 stages"),
     ([0, 8], "positive integers")],
)
def test_bad_balance_names_the_problem(balance, message):
    with pytest.raises(ValueError, match=message):
        stage_ranges(PipelineParallelConfig(2, 4), 8, balance)
