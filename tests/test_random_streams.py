"""Each micro-batch's forward on a stage draws from a stream of its own, re-seeded alike when it is re-computed.

In one process: the seed derivation and the seeded run. The pipeline's masks (stages, micro-batches, the retained
fraction, re-computation, reproducibility) are measured on 2 and 4 processes in ``test_equivalence.py``.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_pipe.execution.random_streams import StageRandomStreams, micro_batch_seed, seeded

CPU = torch.device("cpu")


def test_every_step_replica_stage_and_micro_batch_gets_its_own_seed():
    state = torch.random.get_rng_state().numpy().tobytes()
    grid = list(itertools.product(range(3), range(2), range(4), range(8)))  # step, replica, stage, micro-batch
    seeds = [micro_batch_seed(state, *where) for where in grid]
    assert len(set(seeds)) == len(grid)
    assert all(0 <= seed < 2**63 for seed in seeds)
    assert seeds == [micro_batch_seed(state, *where) for where in grid]  # the same arguments, the same seed
    other_state = bytes([state[0] ^ 1]) + state[1:]
    assert micro_batch_seed(other_state, 0, 0, 0, 0) != seeds[0]


def test_seeded_draws_from_the_seed_and_leaves_the_global_stream_as_it_was():
    torch.manual_seed(0)
    expected = torch.rand(4)
    torch.manual_seed(0)
    with seeded(CPU, 123):
        inside = torch.rand(4)
    with seeded(CPU, 123):
        assert torch.equal(torch.rand(4), inside)
    assert torch.equal(torch.rand(4), expected)  # as if nothing had been drawn


def dropout_gradient(streams: StageRandomStreams | None, recompute: bool) -> torch.Tensor:
    """The input gradient of one micro-batch through a dropout layer, with its forward re-computed or not."""
    torch.manual_seed(1)
    layer = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    x = torch.randn(16, 8, requires_grad=True)
    run = layer if streams is None else streams.seeded_run(layer, micro_batch=2)
    torch.manual_seed(2)
    # Without preserve_rng_state the re-computation draws whatever the generator holds in backward: only the seeded
    # run can make it draw the forward's mask again.
    out = checkpoint(run, x, use_reentrant=False, preserve_rng_state=False) if recompute else run(x)
    torch.rand(100)  # the global stream moves on before backward, as the other micro-batches' forwards move it
    out.sum().backward()
    return x.grad


def test_recomputation_draws_the_same_mask_as_the_forward():
    def streams() -> StageRandomStreams:
        torch.manual_seed(3)
        stage_streams = StageRandomStreams(CPU, stage=1, replica=0)
        stage_streams.begin_step()
        return stage_streams

    assert torch.equal(dropout_gradient(streams(), recompute=True), dropout_gradient(streams(), recompute=False))
    # The control: drawn from the global stream, the re-computation's mask differs from the forward's.
    assert not torch.equal(dropout_gradient(None, recompute=True), dropout_gradient(None, recompute=False))


def test_each_step_draws_new_masks_even_when_nothing_else_draws_random_numbers():
    """The layers do not advance the global stream, so each step's seed counts the steps too."""
    torch.manual_seed(4)
    streams = StageRandomStreams(CPU, stage=0, replica=0)
    dropout = nn.Dropout(0.5)
    masks = []
    for _ in range(2):
        streams.begin_step()
        masks.append(streams.seeded_run(dropout, micro_batch=0)(torch.ones(64)) != 0)
    assert not torch.equal(masks[0], masks[1])


def test_replicas_draw_different_masks():
    torch.manual_seed(5)
    masks = []
    for replica in range(2):
        streams = StageRandomStreams(CPU, stage=0, replica=replica)
        streams.begin_step()
        masks.append(streams.seeded_run(nn.Dropout(0.5), micro_batch=0)(torch.ones(64)) != 0)
    assert not torch.equal(masks[0], masks[1])
