"""The layout of ranks over pipeline stages and data-parallel replicas."""

import pytest

from lightning_pipe.partition.topology import PipelineLayout


@pytest.mark.parametrize("outermost", [True, False], ids=["pipeline-outermost", "replicas-outermost"])
@pytest.mark.parametrize(("stages", "replicas"), [(1, 1), (2, 1), (4, 1), (2, 2), (3, 2), (2, 4)])
def test_every_rank_holds_one_stage_of_one_replica(stages, replicas, outermost):
    layout = PipelineLayout(stages, replicas, pipeline_outermost=outermost)
    seen = {(layout.stage(r), layout.replica(r)) for r in range(layout.world_size)}
    assert seen == {(s, p) for s in range(stages) for p in range(replicas)}
    for rank in range(layout.world_size):
        assert layout.rank(layout.stage(rank), layout.replica(rank)) == rank


def test_rank_zero_holds_the_last_stage():
    for layout in (PipelineLayout(4), PipelineLayout(2, 2), PipelineLayout(2, 2, pipeline_outermost=False)):
        assert layout.stage(0) == layout.num_stages - 1 and layout.replica(0) == 0


def test_pipeline_outermost_keeps_replicas_on_neighbouring_ranks():
    layout = PipelineLayout(num_stages=2, num_replicas=4)
    assert layout.replica_ranks(stage=1) == [0, 1, 2, 3]  # one node's gradient all-reduce
    assert layout.pipeline_ranks(replica=0) == [4, 0]  # activations cross to the other node
    inner = PipelineLayout(num_stages=2, num_replicas=4, pipeline_outermost=False)
    assert inner.pipeline_ranks(replica=0) == [1, 0]
