"""The planner's core (``schedules.planner.predict``): a schedule's step, bubble and peak activation memory per stage
from per-stage or per-chunk costs and a message time, checked against the schedules' known formulas."""

from __future__ import annotations

import pytest

from lightning_pipe.schedules.planner import ComputeCosts, predict

EVEN = ComputeCosts(forward=0.01, input_gradient=0.01, weight_gradient=0.01, activation_bytes=1000)


@pytest.mark.parametrize(("s", "m"), [(4, 4), (4, 16), (8, 8)])
def test_gpipe_takes_m_plus_s_minus_one_slots_and_holds_every_micro_batch(s, m):
    prediction = predict("gpipe", s, m, EVEN)
    assert prediction.step == pytest.approx((m + s - 1) * 0.03)
    assert prediction.bubble == pytest.approx((s - 1) / (m + s - 1))
    assert prediction.peak_activation_bytes == (m * 1000,) * s


def test_one_f_one_b_holds_at_most_s_micro_batches_at_gpipes_step():
    prediction = predict("1f1b", 4, 16, EVEN)
    assert prediction.step == pytest.approx(predict("gpipe", 4, 16, EVEN).step)
    assert prediction.peak_activation_bytes == (4000, 3000, 2000, 1000)


def test_zero_bubble_schedules_predict_the_gain_of_deferred_weight_gradients():
    gpipe, zb, zbv = (predict(name, 4, 8, EVEN).step for name in ("gpipe", "zero_bubble", "zbv"))
    assert zbv < zb < gpipe
    assert zb == pytest.approx((3 * 8 + 4 - 1) * 0.01)  # ZB-H1: (S - 1) ticks of bubble, a third of 1F1B's


def test_each_message_delays_each_stage_boundary_on_the_way_down_and_up():
    step = predict("gpipe", 4, 8, EVEN).step
    assert predict("gpipe", 4, 8, EVEN, send_time=0.002).step == pytest.approx(step + 2 * 3 * 0.002)


def test_a_heavy_stage_given_per_stage_or_per_chunk_predicts_the_same():
    heavy = ComputeCosts(0.02, 0.02, 0.02, 2000)
    per_stage = predict("interleaved_1f1b", 4, 8, [EVEN, EVEN, EVEN, heavy], virtual_stages=2)
    # With two chunks per stage in a loop, stage 3 holds chunks 3 and 7: each half of its cost.
    per_chunk = [heavy.share(2) if k in (3, 7) else EVEN.share(2) for k in range(8)]
    assert predict("interleaved_1f1b", 4, 8, per_chunk, virtual_stages=2) == per_stage
    # Every micro-batch passes at the heavy stage's pace: M of its slots, plus the fill and the drain.
    assert per_stage.step >= 8 * 0.06
    assert per_stage.stage_bubbles[3] < min(per_stage.stage_bubbles[:3])


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: predict("gpipe", 4, 8, [EVEN] * 3), r"3 costs given; give one ComputeCosts for all, 4 \(one per stage\)"),
        (lambda: predict("gpipe", 4, 8, EVEN, send_time=-1), r"send_time=-1\): the seconds a message takes"),
        (lambda: ComputeCosts(forward=-0.1, input_gradient=0, weight_gradient=0), r"forward=-0.1\): a cost is a number"),
    ],
)
def test_bad_costs_are_refused_naming_the_fix(call, message):
    with pytest.raises(ValueError, match=message):
        call()
