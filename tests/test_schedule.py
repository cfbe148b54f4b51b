"""The schedules as data: each stage's action list, the checker that rejects a broken one, the simulated timeline,
its bubble beside each schedule's formula, the activations in flight, and the tick tables in the docstrings."""

from __future__ import annotations

import re
import textwrap
from fractions import Fraction

import pytest

from lightning_pipe.schedules import actions as actions_module
from lightning_pipe.schedules import builtin as builtin_module
from lightning_pipe.schedules import simulator as simulator_module
from lightning_pipe.schedules.actions import Action, PipelineSchedule, custom_schedule, stage_chunks
from lightning_pipe.schedules.builtin import SCHEDULES, gpipe, gpipe_schedule
from lightning_pipe.schedules.simulator import check_schedule, clock_cycles, ideal_bubble, render_timeline

# Each built-in schedule with the chunk counts per stage it is checked with.
CONFIGURATIONS = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3), ("zero_bubble", 1),
                  ("zbv", 2)]
SHORT = {"recv": "R", "forward": "F", "send": "S", "recv_grad": "r", "backward": "B", "backward_input": "I",
         "backward_weight": "W", "send_grad": "s"}


def short(actions: list[Action]) -> list[str]:
    """``F3`` for forward(micro-batch 3) (with ``.k`` for chunk k when it is not the stage's only one)."""
    return [f"{SHORT[a.kind]}{a.micro_batch}" for a in actions]


def idle_ticks(name: str | PipelineSchedule, num_stages: int, num_micro_batches: int) -> list[int]:
    simulation = clock_cycles(num_stages, num_micro_batches, name)
    return [simulation.makespan - sum(a.end - a.start for a in stage) for stage in simulation.intervals]


@pytest.mark.parametrize(("name", "virtual_stages"), CONFIGURATIONS)
def test_every_built_in_schedule_passes_the_checker(name, virtual_stages):
    """Complete, in dependency order, messages in matching order, no deadlock: S in 2..4 and every M from 1 to 4S
    (S..4S as configured, fewer for a smaller last batch)."""
    for num_stages in (2, 3, 4):
        check_schedule(SCHEDULES[name], num_stages, 4 * num_stages, virtual_stages)


def test_gpipe_lists_every_forward_then_the_backwards_in_reverse_with_their_messages():
    assert short(gpipe(0, 1, 3)) == ["F0", "F1", "F2", "B2", "B1", "B0"]
    assert short(gpipe(1, 3, 2)) == ["R0", "F0", "S0", "R1", "F1", "S1", "r1", "B1", "s1", "r0", "B0", "s0"]
    assert short(gpipe(0, 2, 2)) == ["F0", "S0", "F1", "S1", "r1", "B1", "r0", "B0"]
    assert short(gpipe(1, 2, 2)) == ["R0", "F0", "R1", "F1", "B1", "s1", "B0", "s0"]
    assert {a.chunk for a in gpipe(1, 3, 2)} == {1}
    assert SCHEDULES["gpipe"].per_micro_batch is False


def test_split_backward_sends_the_input_gradient_before_computing_the_weight_gradient():
    """GPipe's drain shrinks from (S-1)(I+W) to (S-1)I: 2(S-1) idle ticks per stage instead of 3(S-1)."""
    assert short(gpipe(1, 3, 2, split_backward=True))[6:] == ["r1", "I1", "s1", "W1", "r0", "I0", "s0", "W0"]
    split = gpipe_schedule(split_backward=True)
    for num_stages, num_micro_batches in ((2, 4), (4, 8)):
        assert idle_ticks(split, num_stages, num_micro_batches) == [2 * (num_stages - 1)] * num_stages
        assert idle_ticks("gpipe", num_stages, num_micro_batches) == [3 * (num_stages - 1)] * num_stages
    assert clock_cycles(4, 8, split).bubble_fraction == pytest.approx(ideal_bubble(split, 4, 8, 1)) == 6 / 30


def test_one_f_one_b_holds_at_most_as_many_micro_batches_as_stages_from_its_own_on():
    """1F1B's point: stage s holds S - s micro-batches' activations, not M (GPipe holds all M)."""
    for num_stages in (2, 3, 4):
        for num_micro_batches in range(num_stages, 4 * num_stages + 1):
            peaks = clock_cycles(num_stages, num_micro_batches, "1f1b").peak_in_flight
            assert peaks == tuple(range(num_stages, 0, -1))
            assert clock_cycles(num_stages, num_micro_batches).peak_in_flight == (num_micro_batches,) * num_stages
    assert short(SCHEDULES["1f1b"].actions(0, 3, 4, 1)) == [
        "F0", "S0", "F1", "S1", "F2", "S2", "r0", "B0", "F3", "S3", "r1", "B1", "r2", "B2", "r3", "B3"]


def test_zero_bubble_holds_no_more_than_one_f_one_b_at_its_peak():
    """ZB-H1 defers stage s's first s weight gradients: every stage then holds S micro-batches, 1F1B's peak (its
    first stage's); the later stages hold more than under 1F1B, none more than S."""
    for num_stages in (2, 3, 4):
        for num_micro_batches in range(num_stages, 4 * num_stages + 1):
            zero_bubble = clock_cycles(num_stages, num_micro_batches, "zero_bubble").peak_in_flight
            one_f_one_b = clock_cycles(num_stages, num_micro_batches, "1f1b").peak_in_flight
            assert zero_bubble == (num_stages,) * num_stages and max(zero_bubble) == max(one_f_one_b)


def test_interleaving_holds_the_first_round_of_chunks_and_two_per_stage_further_down():
    """Interleaved 1F1B, M a multiple of S: (v-1)·S + 2(S-1-s) + 1 chunk activations on stage s, in units of
    1/v of the stage's; ZB-V: 2S chunk activations (S micro-batches of the whole stage) on every stage."""
    for v in (2, 3):
        assert clock_cycles(4, 8, "interleaved_1f1b", v).peak_in_flight == tuple(
            (v - 1) * 4 + 2 * (3 - s) + 1 for s in range(4))
    assert clock_cycles(4, 8, "zbv").peak_in_flight == (8, 8, 8, 8)
    assert clock_cycles(3, 4, "zbv").peak_in_flight == (5, 6, 6)  # fewer than 2S-1 micro-batches: less


# Simulated bubbles (idle share of the makespan; F = I = W = 1 tick, a full backward 2) beside each formula.
@pytest.mark.parametrize(
    ("name", "v", "formula"),
    [
        ("gpipe", 1, lambda s, m, v: Fraction(s - 1, m + s - 1)),
        ("1f1b", 1, lambda s, m, v: Fraction(s - 1, m + s - 1)),  # GPipe's bubble, less memory
        ("interleaved_1f1b", 2, lambda s, m, v: Fraction(s - 1, v * m + s - 1)),  # every M >= S, not only multiples
        ("interleaved_1f1b", 3, lambda s, m, v: Fraction(s - 1, v * m + s - 1)),
        ("zero_bubble", 1, lambda s, m, v: Fraction(s - 1, 3 * m + s - 1)),  # a third of 1F1B's idle time
        ("zbv", 2, lambda s, m, v: Fraction(s - 1, 6 * m + s - 1)),  # M >= 2S-1: half of ZB-H1's idle time
    ],
)
def test_simulated_bubble_is_the_schedule_formula(name, v, formula):
    schedule = SCHEDULES[name]
    for num_stages in (2, 3, 4):
        first = 2 * num_stages - 1 if name == "zbv" else num_stages
        for num_micro_batches in range(first, 4 * num_stages + 1):
            simulated = clock_cycles(num_stages, num_micro_batches, schedule, v).bubble_fraction
            expected = float(formula(num_stages, num_micro_batches, v))
            assert simulated == pytest.approx(expected, abs=1e-12), (num_stages, num_micro_batches)
            assert ideal_bubble(schedule, num_stages, num_micro_batches, v) == pytest.approx(expected, abs=1e-12)


def test_bubbles_at_four_stages_and_eight_micro_batches_in_idle_ticks_per_stage():
    """The numbers docs/schedules.md quotes. A tick is one chunk's forward: interleaved and ZB-V ticks are 1/v of
    the others'. 1F1B idles as GPipe, ZB-H1 a third of that, ZB-V (two chunks) a sixth."""
    assert idle_ticks("gpipe", 4, 8) == idle_ticks("1f1b", 4, 8) == [9] * 4  # 9 of 33 ticks: 3/11
    assert idle_ticks(gpipe_schedule(split_backward=True), 4, 8) == [6] * 4  # 6 of 30: 1/5
    assert idle_ticks("interleaved_1f1b", 4, 8) == [9] * 4  # 9 of 57: 3/19
    assert idle_ticks("zero_bubble", 4, 8) == [3] * 4  # 3 of 27: 1/9
    assert idle_ticks("zbv", 4, 8) == [3] * 4  # 3 of 51: 1/17
    # Below 2S-1 micro-batches ZB-V's warm-up has gaps: 4 micro-batches, 30 ticks, a fifth idle.
    assert clock_cycles(4, 4, "zbv").makespan == 30 and clock_cycles(4, 4, "zbv").bubble_fraction == pytest.approx(0.2)


def test_interleaved_one_f_one_b_runs_any_micro_batch_count():
    """M // S rounds of at least S micro-batches, as even as possible, where torch and Megatron need S to divide M:
    at S=4, 10 micro-batches run as 5 + 5, 11 as 6 + 5, 5 as one round."""
    assert builtin_module._rounds(10, 4) == [range(0, 5), range(5, 10)]
    assert builtin_module._rounds(11, 4) == [range(0, 6), range(6, 11)]
    assert builtin_module._rounds(5, 4) == [range(0, 5)] and builtin_module._rounds(3, 4) == [range(0, 3)]
    actions = SCHEDULES["interleaved_1f1b"].actions(1, 2, 3, 2)
    forwards = [(a.chunk, a.micro_batch) for a in actions if a.kind == "forward"]
    assert forwards == [(1, 0), (1, 1), (1, 2), (3, 0), (3, 1), (3, 2)]


def test_placements_put_chunks_in_a_loop_or_a_v():
    assert [stage_chunks(s, 4, 2, "loop") for s in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [stage_chunks(s, 4, 2, "v") for s in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert SCHEDULES["zbv"].owner(7, 4) == 0 and SCHEDULES["interleaved_1f1b"].owner(7, 4) == 3
    # The last stage of a V runs its two chunks back to back: no message between them.
    messages = {(a.kind, a.chunk) for a in SCHEDULES["zbv"].actions(3, 4, 8, 2) if a.kind in ("send", "recv")}
    assert messages == {("recv", 3), ("send", 4)}  # from stage 2 into chunk 3; out of chunk 4 to stage 2


@pytest.mark.parametrize(
    ("name", "mode", "stage", "expected"),
    [
        ("gpipe", "except_last", 0, [True, True, True, False]),  # the last micro-batch's backward comes next
        ("gpipe", "always", 1, [True] * 4),
        ("gpipe", "never", 1, [False] * 4),
        ("1f1b", "except_last", 1, [False] * 4),  # last stage: every forward is followed by its own backward
        ("1f1b", "except_last", 0, [True] * 4),  # first stage: another forward or backward comes between
        ("zero_bubble", "except_last", 1, [False] * 4),  # its input gradient counts as its backward
    ],
)
def test_checkpoint_mode_decides_which_forwards_recompute(name, mode, stage, expected):
    actions = SCHEDULES[name].stage_actions(stage, 2, 4, 1, mode)
    assert [a.recompute for a in actions if a.kind == "forward"] == expected
    assert not any(a.recompute for a in actions if a.kind != "forward")


def test_virtual_stages_default_to_the_schedule_and_are_checked():
    assert [SCHEDULES[name].checked_virtual_stages(None) for name in SCHEDULES] == [1, 1, 2, 1, 2]
    assert SCHEDULES["interleaved_1f1b"].checked_virtual_stages(4) == 4
    with pytest.raises(ValueError, match=r"^virtual_stages=2 is invalid for schedule='1f1b', which runs exactly 1"):
        SCHEDULES["1f1b"].checked_virtual_stages(2)
    with pytest.raises(ValueError, match=r"^strategy.virtual_stages=True is invalid for strategy.schedule='zbv'"):
        SCHEDULES["zbv"].checked_virtual_stages(True, key="strategy.")


# ---- the checker catches each broken rule ---------------------------------------------------------------------


def edited(base: str, edit) -> PipelineSchedule:
    """``base``'s lists passed through ``edit(stage, actions) -> actions``, as a user's schedule."""

    def actions(stage: int, num_stages: int, num_micro_batches: int, virtual_stages: int) -> list[Action]:
        return edit(stage, SCHEDULES[base].actions(stage, num_stages, num_micro_batches, virtual_stages))

    return PipelineSchedule("edited", actions, per_micro_batch=SCHEDULES[base].per_micro_batch)


def without(kinds: tuple[str, ...], micro_batch: int, on_stage: int):
    return lambda stage, actions: [a for a in actions if stage != on_stage or (a.kind, a.micro_batch) not in
                                   {(kind, micro_batch) for kind in kinds}]


def moved(index: int, to: int, on_stage: int):
    def edit(stage: int, actions: list[Action]) -> list[Action]:
        if stage == on_stage:
            actions = list(actions)
            actions.insert(to, actions.pop(index))
        return actions

    return edit


def test_the_unbroken_edit_passes():  # the negative tests below change one thing each
    clock_cycles(2, 3, edited("1f1b", lambda stage, actions: actions))


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        (edited("1f1b", without(("backward", "send_grad"), 0, on_stage=1)),
         r"stage 1's backward\(chunk 1, micro-batch 0\) never runs: every \(chunk, micro-batch\) needs one forward"),
        (edited("1f1b", lambda s, acts: acts + [Action("forward", 0, s)]),
         r"stage 0's action 12, forward\(chunk 0, micro-batch 0\), runs twice"),
        # Stage 1 (the last) computes forward 0 before receiving it.
        (edited("1f1b", moved(1, 0, on_stage=1)),
         r"stage 1's action 0, forward\(chunk 1, micro-batch 0\), runs before its receive, which provides its input"),
        (edited("1f1b", moved(5, 0, on_stage=0)),  # stage 0: F0 S0 F1 S1 r0 B0 ...; B0 first
         r"stage 0's action 0, backward\(chunk 0, micro-batch 0\), runs before its forward"),
        (edited("zero_bubble", moved(8, 2, on_stage=1)),  # stage 1: R0 F0 I0 s0 R1 F1 I1 s1 W0 ...; W0 before I0
         r"stage 1's action 2, backward_weight\(chunk 1, micro-batch 0\), runs before its backward_input"),
        (edited("gpipe", lambda s, acts: [Action("forward", 0, 1 - s)] + acts[1:] if s == 0 else acts),
         r"stage 0's action 0, forward\(chunk 1, micro-batch 0\), runs a chunk that the 'loop' placement puts on"
         r" stage 1"),
        (edited("gpipe", lambda s, acts: [Action("recv", 0, 0), *acts] if s == 0 else acts),
         r"stage 0's action 0, recv\(chunk 0, micro-batch 0\), crosses no stage boundary: the chunk's input is"),
    ],
    ids=["missing backward", "duplicated forward", "forward before its input", "backward before its forward",
         "weight gradient before input gradient", "chunk on the wrong stage", "message within a stage"],
)
def test_checker_names_the_stage_the_action_and_the_broken_rule(schedule, message):
    with pytest.raises(ValueError, match=message) as error:
        clock_cycles(2, 3, schedule)
    assert str(error.value).startswith("schedule 'edited' with 2 stages, 3 micro-batches and 1 chunk per stage: ")


def test_checker_refuses_a_backward_before_the_last_forward_under_a_whole_batch_loss():
    interleaving = edited("1f1b", lambda stage, actions: actions)
    whole_batch = PipelineSchedule("edited", interleaving.actions, per_micro_batch=False)
    with pytest.raises(ValueError, match=r"stage 1's action 2, backward\(chunk 1, micro-batch 0\), runs before the"
                                         r" forward of micro-batch 1: the loss is computed on the whole mini-batch"):
        clock_cycles(2, 3, whole_batch)


def test_checker_finds_receives_out_of_the_senders_order():
    """Stage 1 receives micro-batch 1 before 0; stage 0 sends 0 first: point-to-point messages match in order."""
    def swap_receives(stage: int, actions: list[Action]) -> list[Action]:
        if stage == 0:
            return actions
        order = [a for a in actions if a.kind in ("recv", "forward")]
        rest = [a for a in actions if a not in order]
        return order[2:4] + order[0:2] + order[4:] + rest

    message = (
        r"stage 1's action 0, recv\(chunk 1, micro-batch 1\), is its receive number 0 from stage 0, but stage 0's"
        r" send number 0 there is send\(chunk 0, micro-batch 0\) \(action 1\): a stage must receive its activations in"
        r" the order they are sent"
    )
    with pytest.raises(ValueError, match=message):
        clock_cycles(2, 2, edited("gpipe", swap_receives))


def test_checker_finds_a_message_that_is_never_received():
    dropped = edited("gpipe", lambda stage, actions: [a for a in actions if (stage, a.kind) != (0, "recv_grad")])
    with pytest.raises(ValueError, match=r"stage 0's action 4, backward\(chunk 0, micro-batch 1\), runs before its"
                                         r" recv_grad, which provides its output's gradient"):
        clock_cycles(2, 2, dropped)
    extra = edited("gpipe", lambda stage, actions: actions + [Action("send", 0, 0)] if stage == 0 else actions)
    with pytest.raises(ValueError, match=r"stage 0's action 8, send\(chunk 0, micro-batch 0\), runs twice"):
        clock_cycles(2, 2, extra)


def test_checker_finds_a_deadlock():
    """Stage 0 waits for a gradient before sending the activation that stage 1 needs to produce it."""
    def gradient_first(stage: int, actions: list[Action]) -> list[Action]:
        return [Action("forward", 0, 0), Action("recv_grad", 0, 0), Action("send", 0, 0), Action("backward", 0, 0)] \
            if stage == 0 else actions

    with pytest.raises(ValueError, match=r"deadlock, no stage can proceed while actions remain: stage 0 waits at action"
                                         r" 1, recv_grad\(chunk 0, micro-batch 0\), for stage 1; stage 1 waits at"
                                         r" action 0, recv\(chunk 1, micro-batch 0\), for stage 0\."):
        clock_cycles(2, 1, edited("gpipe", gradient_first))


# ---- the user's own schedule -----------------------------------------------------------------------------------


def test_a_users_function_becomes_a_schedule_that_interleaves_when_its_lists_do():
    def forwards_first(stage, num_stages, num_micro_batches, virtual_stages):
        return gpipe(stage, num_stages, num_micro_batches)

    def one_by_one(stage, num_stages, num_micro_batches, virtual_stages):
        return SCHEDULES["1f1b"].actions(stage, num_stages, num_micro_batches, virtual_stages)

    assert custom_schedule(forwards_first).per_micro_batch is False
    wrapped = custom_schedule(one_by_one, num_stages=3)
    assert wrapped.per_micro_batch is True and wrapped.name == "one_by_one"
    assert wrapped.checked_virtual_stages(None) == 1 and wrapped.checked_virtual_stages(3) == 3
    check_schedule(wrapped, 3, 12)
    assert clock_cycles(3, 6, wrapped).bubble_fraction == clock_cycles(3, 6, "1f1b").bubble_fraction


# ---- the pictures ----------------------------------------------------------------------------------------------

# A docstring's table follows the call that draws it: ``render_timeline(4, 8, "1f1b")``::
TABLE = re.compile(
    r"``render_timeline\((?P<args>[^`]*)\)``\)?::\n\n(?P<table>(?P<indent>[ ]+)tick.*\n(?:(?P=indent)stage .*\n)*)"
)
DOCUMENTED = [actions_module, builtin_module.gpipe, builtin_module.one_f_one_b,
              builtin_module.interleaved_one_f_one_b, builtin_module.zero_bubble, builtin_module.zbv]


@pytest.mark.parametrize("documented", DOCUMENTED, ids=lambda d: d.__name__)
def test_docstring_tables_are_what_the_renderer_draws(documented):
    tables = list(TABLE.finditer(documented.__doc__))
    assert tables, f"{documented.__name__}'s docstring shows no tick table"
    for table in tables:
        drawn = eval(f"render_timeline({table['args']})", {**vars(builtin_module), **vars(simulator_module)})  # noqa: S307 (our own docstring)
        assert textwrap.dedent(table["table"]).rstrip("\n") == drawn, f"redraw it:\n{drawn}"


def test_rendered_timeline_names_chunks_and_marks_multi_tick_actions():
    lines = render_timeline(2, 2, "1f1b").splitlines()
    assert lines[1].split() == ["stage", "0", "F0", "F1", ".", ".", "B0", "--", ".", "B1", "--"]
    interleaved = render_timeline(2, 2, "interleaved_1f1b").splitlines()
    assert interleaved[1].split()[2:6] == ["F0a", "F1a", "F0b", "F1b"]  # a: the stage's first chunk, b: its second
    assert interleaved[1].split()[-2:] == ["B1a", "---"]


def test_costs_per_chunk_time_a_step_with_a_heavy_last_stage():
    """GPipe's step is (M + S - 1) times its slowest stage's F + B: a last stage twice as heavy doubles the ticks of
    every micro-batch through it, and seconds give seconds."""
    even = {"forward": 1, "backward_input": 1, "backward_weight": 1, "backward": 2}
    heavy = {kind: 2 * cost for kind, cost in even.items()}
    assert clock_cycles(4, 8, "gpipe", costs=[even, even, even, heavy]).makespan == 3 * (4 - 1) + 6 * 8
    assert clock_cycles(4, 8, "gpipe", costs={k: 0.01 * c for k, c in even.items()}).makespan == pytest.approx(0.33)
    with pytest.raises(ValueError, match="costs name 3 chunks but the step has 4; give one mapping per chunk"):
        clock_cycles(4, 8, "gpipe", costs=[even] * 3)
    with pytest.raises(ValueError, match=r"the costs of chunk 0 lack \['backward'\]"):
        clock_cycles(2, 2, "gpipe", costs={"forward": 1, "backward_input": 1, "backward_weight": 1})
