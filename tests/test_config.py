"""PipelineParallelConfig and the split of blocks into stages."""

import pytest

from lightning_pipe import PipelineParallelConfig
from lightning_pipe.settings import validate_recompute_mode


@pytest.mark.parametrize("num_blocks", range(1, 13))
@pytest.mark.parametrize("num_stages", range(1, 6))
def test_split_covers_every_block_once_with_sizes_within_one(num_stages, num_blocks):
    config = PipelineParallelConfig(num_stages=num_stages, num_micro_batches=4)
    if num_stages > num_blocks:
        with pytest.raises(ValueError, match=f"use at most {num_blocks} stages?[,;]"):
            config.split_into_stages(num_blocks)
        return
    ranges = config.split_into_stages(num_blocks)
    assert len(ranges) == num_stages
    assert [i for r in ranges for i in r] == list(range(num_blocks))
    sizes = [len(r) for r in ranges]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_split_puts_the_extra_blocks_first():
    assert PipelineParallelConfig(3, 4).split_into_stages(8) == [range(0, 3), range(3, 6), range(6, 8)]


def test_split_still_takes_the_former_keyword_num_layers_with_a_warning():
    config = PipelineParallelConfig(3, 4)
    with pytest.warns(DeprecationWarning, match="num_blocks"):
        assert config.split_into_stages(num_layers=8) == config.split_into_stages(num_blocks=8)
    with pytest.raises(ValueError, match="num_blocks=0 is invalid"):
        config.split_into_stages(0)


@pytest.mark.parametrize("field", ["num_stages", "num_micro_batches"])
@pytest.mark.parametrize("value", [0, -2, 1.5, True, "2"])
def test_invalid_counts_name_the_field_and_the_rule(field, value):
    kwargs = {"num_stages": 2, "num_micro_batches": 4, field: value}
    with pytest.raises(ValueError, match=f"{field}=.*positive integer"):
        PipelineParallelConfig(**kwargs)


def test_unknown_checkpoint_mode_lists_the_choices():
    with pytest.raises(ValueError, match="'always', 'except_last', 'never'"):
        validate_recompute_mode("sometimes")
