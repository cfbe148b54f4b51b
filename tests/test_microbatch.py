"""Splitting inputs into micro-batches and joining outputs."""

import pytest
import torch

from lightning_pipe.partition import microbatch


@pytest.mark.parametrize(("batch", "m", "sizes"), [(16, 4, [4] * 4), (10, 4, [3, 3, 2, 2]), (2, 4, [1, 1]), (1, 8, [1])])
def test_split_sizes_differ_by_at_most_one_and_are_never_empty(batch, m, sizes):
    chunks = microbatch.split(torch.arange(batch * 3).view(batch, 3), m)
    assert [len(c) for c in chunks] == sizes


def test_split_and_join_round_trip_a_tuple_without_copying():
    x, mask = torch.randn(10, 4), torch.ones(10, dtype=torch.bool)
    chunks = microbatch.split((x, mask), 3)
    assert all(isinstance(c, tuple) and len(c) == 2 for c in chunks)
    assert chunks[0][0].data_ptr() == x.data_ptr()  # a view
    joined = microbatch.join(chunks)
    assert torch.equal(joined[0], x) and torch.equal(joined[1], mask)


def test_tensors_with_different_batch_sizes_cannot_be_split():
    with pytest.raises(ValueError, match="one common batch dimension"):
        microbatch.split((torch.zeros(4, 2), torch.zeros(5)), 2)


def test_non_tensor_between_stages_is_named():
    with pytest.raises(TypeError, match="is a str \\(item 1\\); only a tensor or a tuple of tensors"):
        microbatch.as_tensors((torch.zeros(1), "mask"), "the output of pipeline stage 0")
