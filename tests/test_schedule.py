"""The GPipe schedule as data: action lists, the ideal timeline and its bubble."""

import pytest

from lightning_pipe.schedule import Action, clock_cycles, gpipe_actions, ideal_bubble_fraction, render_timeline


def test_gpipe_runs_all_forwards_then_backwards_in_reverse():
    assert [str(a) for a in gpipe_actions(3)] == ["F0", "F1", "F2", "B2", "B1", "B0"]
    assert [str(a) for a in gpipe_actions(3, training=False)] == ["F0", "F1", "F2"]


@pytest.mark.parametrize(("stages", "micro_batches"), [(1, 1), (2, 4), (3, 4), (4, 8)])
def test_timeline_respects_dependencies_and_has_the_ideal_bubble(stages, micro_batches):
    timeline = clock_cycles(stages, micro_batches)
    tick = {(s, a.kind, a.micro_batch): t for s, row in enumerate(timeline) for t, a in enumerate(row) if a}
    for s in range(stages):
        for m in range(micro_batches):
            if s > 0:
                assert tick[(s, "forward", m)] > tick[(s - 1, "forward", m)]
                assert tick[(s - 1, "backward", m)] > tick[(s, "backward", m)]
    idle = sum(a is None for a in timeline[0]) / len(timeline[0])
    assert idle == pytest.approx(ideal_bubble_fraction(stages, micro_batches))


def test_rendered_timeline_matches_the_documented_picture():
    lines = render_timeline(3, 4).splitlines()
    assert lines[1].split() == ["stage", "0", "F0", "F1", "F2", "F3", ".", ".", ".", ".", "B3", "B2", "B1", "B0"]
    assert Action("backward", 2).__str__() == "B2"
