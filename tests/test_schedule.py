"""The GPipe schedule as data: action lists, the ideal timeline and its bubble."""

import pytest

from lightning_pipe.schedule import (
    Action,
    clock_cycles,
    gpipe,
    ideal_bubble_fraction,
    phases,
    recomputes,
    render_timeline,
)


def test_gpipe_runs_all_forwards_then_backwards_in_reverse():
    compute = lambda actions: [str(a) for a in actions if a.kind in ("forward", "backward")]  # noqa: E731
    assert compute(gpipe(0, 1, 3, "never")) == ["F0", "F1", "F2", "B2", "B1", "B0"]
    # A middle stage receives, runs and sends each micro-batch, then the same for gradients in reverse.
    assert [str(a) for a in gpipe(1, 3, 2, "never")] == ["R0", "F0", "S0", "R1", "F1", "S1", "r1", "B1", "s1", "r0", "B0", "s0"]
    assert [str(a) for a in gpipe(0, 2, 2, "never")] == ["F0", "S0", "F1", "S1", "r1", "B1", "r0", "B0"]
    assert [str(a) for a in gpipe(1, 2, 2, "never")] == ["R0", "F0", "R1", "F1", "B1", "s1", "B0", "s0"]


@pytest.mark.parametrize(("mode", "expected"), [("always", [True] * 4), ("except_last", [True] * 3 + [False]), ("never", [False] * 4)])
def test_checkpoint_mode_decides_which_forwards_recompute(mode, expected):
    assert [recomputes(mode, m, 4) for m in range(4)] == expected
    assert [a.recompute for a in gpipe(1, 3, 4, mode) if a.kind == "forward"] == expected


def test_a_schedule_must_run_every_forward_before_the_first_backward():
    forwards, backwards = phases(gpipe(0, 2, 3, "never"), 3)
    assert [str(a) for a in forwards] == ["F0", "S0", "F1", "S1", "F2", "S2"]
    interleaved = [Action("forward", 0), Action("backward", 0), Action("forward", 1), Action("backward", 1)]
    with pytest.raises(ValueError, match="every forward must come before the first backward"):
        phases(interleaved, 2)
    with pytest.raises(ValueError, match="backwards cover micro-batches \\[0\\], not each of 0..1 once"):
        phases([Action("forward", 0), Action("forward", 1), Action("backward", 0)], 2)


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
