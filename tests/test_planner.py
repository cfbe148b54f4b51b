"""The planner's core (``schedules.planner.predict``): a schedule's step, bubble and peak activation memory per stage
from per-stage or per-chunk costs and a message time, checked against the schedules' known formulas."""

from __future__ import annotations

import pytest

from lightning_pipe.schedules.choice import BlockCosts, CostModel, configurations, rank_configurations
from lightning_pipe.schedules.planner import ComputeCosts, MeasuredStep, RuntimeCosts, fitted_runtime_costs, predict

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


def test_the_runtimes_cost_per_action_delays_every_compute_on_the_critical_path():
    # GPipe's critical path is M + S - 1 forwards and as many backwards, each now a runtime cost later.
    ideal = predict("gpipe", 4, 8, EVEN)
    costly = predict("gpipe", 4, 8, EVEN, action_time=0.001)
    assert costly.step == pytest.approx(ideal.step + 2 * (8 + 4 - 1) * 0.001)
    assert costly.bubble > ideal.bubble  # the runtime's time is not compute
    # With split backward there are three actions per micro-batch, and zero_bubble's step grows by more.
    zb_ideal, zb_costly = (predict("zero_bubble", 4, 8, EVEN, action_time=a).step for a in (0.0, 0.001))
    assert zb_costly - zb_ideal > costly.step - ideal.step


def test_the_runtime_costs_fitted_to_measured_steps_are_those_that_gave_them():
    runtime = RuntimeCosts(action_time=0.0007, send_time=0.002)
    steps = [
        MeasuredStep(predict(name, 4, 2, EVEN, v, runtime.send_time, action_time=runtime.action_time).step, name, 4, 2,
                     EVEN, v)
        for name, v in (("gpipe", 1), ("interleaved_1f1b", 4), ("zero_bubble", 1))
    ]
    fitted = fitted_runtime_costs(steps)
    assert fitted.action_time == pytest.approx(runtime.action_time, abs=5e-5)
    assert fitted.send_time == pytest.approx(runtime.send_time, abs=5e-5)
    # Steps no longer than the ideal ones: the runtime costs nothing visible.
    ideal = [MeasuredStep(predict("gpipe", 4, 2, EVEN).step * 0.95, "gpipe", 4, 2, EVEN)]
    assert fitted_runtime_costs(ideal) == RuntimeCosts(0.0, 0.0)


def test_a_costly_runtime_turns_the_choice_to_fewer_micro_batches():
    block = BlockCosts(samples=4, forward=0.002, input_gradient=0.002, weight_gradient=0.002,
                       activation_bytes=1e6, input_bytes=1e5, parameter_bytes=1e6)
    model = CostModel.measured([block] * 8, [block.scaled(16)] * 8)  # proportional: more micro-batches, smaller
    candidates = configurations(4, 64, 8, ("1f1b",), recompute=("never",))
    ideal = rank_configurations(model, 4, 64, candidates=candidates)
    costly = rank_configurations(model, 4, 64, candidates=candidates, runtime=RuntimeCosts(0.003, 0.002))
    assert ideal[0].configuration.num_micro_batches == 16  # the smaller bubble wins when actions are free
    assert costly[0].configuration.num_micro_batches == 8  # the actions of 16 cost more than their smaller bubble
    assert all(c.step > i.step for c, i in zip(sorted(costly, key=str), sorted(ideal, key=str)))


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
        (lambda: predict("gpipe", 4, 8, EVEN, action_time=-1), r"action_time=-1\): the runtime's own seconds"),
        (lambda: RuntimeCosts(action_time=0.001, send_time=-2), r"RuntimeCosts\(send_time=-2\): seconds, 0 or more"),
    ],
)
def test_bad_costs_are_refused_naming_the_fix(call, message):
    with pytest.raises(ValueError, match=message):
        call()
