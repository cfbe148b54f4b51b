"""PipelineParallelConfig and the split of layers into stages."""

import pytest

from lightning_pipe import PipelineParallelConfig
from lightning_pipe.settings import validate_recompute_mode


@pytest.mark.parametrize("num_layers", range(1, 13))
@pytest.mark.parametrize("num_stages", range(1, 6))
def test_split_covers_every_layer_once_with_sizes_within_one(num_stages, num_layers):
    config = PipelineParallelConfig(num_stages=num_stages, num_micro_batches=4)
    if num_stages > num_layers:
        with pytest.raises(ValueError, match=f"use at most {num_layers} stages?[,;]"):
            config.split_into_stages(num_layers)
        return
    ranges = config.split_into_stages(num_layers)
    assert len(ranges) == num_stages
    assert [i for r in ranges for i in r] == list(range(num_layers))
    sizes = [len(r) for r in ranges]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_split_puts_the_extra_layers_first():
    assert PipelineParallelConfig(3, 4).split_into_stages(8) == [range(0, 3), range(3, 6), range(6, 8)]


@pytest.mark.parametrize("field", ["num_stages", "num_micro_batches"])
@pytest.mark.parametrize("value", [0, -2, 1.5, True, "2"])
def test_invalid_counts_name_the_field_and_the_rule(field, value):
    kwargs = {"num_stages": 2, "num_micro_batches": 4, field: value}
    with pytest.raises(ValueError, match=f"{field}=.*positive integer"):
        PipelineParallelConfig(**kwargs)


def test_unknown_checkpoint_mode_lists_the_choices():
    with pytest.raises(ValueError, match="'always', 'except_last', 'never'"):
        validate_recompute_mode("sometimes")
