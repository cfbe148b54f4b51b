"""A rank that stops making progress is named within seconds, not after the 30-minute timeout: the stall watchdog ends
the run on every rank, each rank's error names its own wait and the rank that stopped, and every rank's Python stack
is written; legitimately slow phases (the first step, a slow loader's first batch, validation, a checkpoint) do not
trip it.

The rule is tested directly (:mod:`lightning_pipe.reliability.stall_rule`); the runs launch ``workers/reliability_faults_worker.py``
(as ``test_reliability.py`` does) with a low floor, so that a stall ends in seconds.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from traceback import FrameSummary

import pytest

from lightning_pipe.reliability.stall_rule import (
    COMPILING_FIRST_STEP_S,
    WARMUP_STEPS,
    WINDOW,
    RankState,
    StallRule,
    StartUp,
    StepClock,
    Verdict,
    Wait,
    stall_message,
    stalled_ranks,
)
from lightning_pipe.reliability.watchdog import main_thread_location
from test_reliability import FaultRun, assert_ended_fast_everywhere, fault, run_with_faults

# ---- the rule --------------------------------------------------------------------------------------------------------

RULE = StallRule(multiple=5.0, floor_s=3.0, first_step_s=40.0)


def clock_after(durations: list[float], rule: StallRule = RULE) -> tuple[StepClock, float]:
    """A clock that started steps of these durations (same epoch and batch shape), and the time now."""
    clock, now = StepClock(rule), 0.0
    for seconds in durations:
        clock.step_starts(now, epoch=0, batch=clock.steps, batch_shape=(16, 4))
        now += seconds
    return clock, now


def test_bound_is_the_multiple_of_the_slowest_recent_step_with_a_floor():
    clock, now = clock_after([9.0, 7.0, 0.2, 0.5, 0.3])  # the first steps (compilation) are not timed
    clock.step_starts(now, epoch=0, batch=5, batch_shape=(16, 4))
    assert list(clock.durations) == pytest.approx([0.2, 0.5, 0.3])
    assert clock.bound_s == 3.0 and clock.last_step_s == pytest.approx(0.3)  # the floor: 5 x 0.5 s is below it
    clock, now = clock_after([1.0, 1.0, 0.8, 1.2])
    clock.step_starts(now, epoch=0, batch=4, batch_shape=(16, 4))
    assert clock.bound_s == pytest.approx(5 * 1.2)  # above the floor: the multiple of the slowest step
    clock, now = clock_after([1.0, 1.0, 2.0] + [0.1] * WINDOW)
    clock.step_starts(now, epoch=0, batch=200, batch_shape=(16, 4))
    assert clock.slowest_s == pytest.approx(0.1)  # a slow step older than the window no longer counts


def test_first_steps_get_the_first_step_bound_until_a_step_is_timed():
    clock = StepClock(RULE)
    bounds = []
    for step in range(WARMUP_STEPS + 2):
        clock.step_starts(0.1 * step, epoch=0, batch=step, batch_shape=(16, 4))
        bounds.append((clock.bound_s, clock.first_step))
    # The warm-up steps and the first regular step (no duration yet) get the first step's bound, then the learned one.
    assert bounds == [(40.0, True)] * (WARMUP_STEPS + 1) + [(3.0, False)]
    assert RULE.explain(0.0, first_step=True) == "a first step's bound, stall_first_step=40 s"
    # A first step is never bounded tighter than a regular one: with 10 s steps, 5 x 10 s.
    clock, now = clock_after([1.0, 1.0, 10.0, 10.0])
    clock.step_starts(now, epoch=1, batch=0, batch_shape=(16, 4))
    assert clock.first_step and clock.bound_s == pytest.approx(50.0)
    assert RULE.explain(10.0, first_step=True) == "5 x the slowest recent step (10.00 s), at least 3 s"


def test_first_steps_bound_is_derived_from_what_the_set_up_measured_unless_given():
    """Without stall_first_step, a first step's waits may last stall_multiple x the set-up's time, at least twice the
    floor: a minute by default, so that a deadlock in a first step ends within two minutes (the ending takes 5-31 s,
    docs/reliability.md); longer where the set-up was slow (a slow loader's first batch, a big model made real), ten
    minutes while torch.compile compiles (not measured before it runs). A given stall_first_step is the bound."""
    default = StallRule()
    assert default.first_step_bound_s(0.0, StartUp(seconds=2.5)) == 60.0 < 120.0
    assert default.first_step_bound_s(0.0, StartUp(seconds=12.0)) == pytest.approx(120.0)  # a slow set-up: 10 x
    assert default.first_step_bound_s(0.0, StartUp(seconds=2.5, compiles=True)) == COMPILING_FIRST_STEP_S
    assert StallRule(first_step_s=600.0).first_step_bound_s(0.0, StartUp(seconds=2.5)) == 600.0
    assert StallRule(first_step_s=45.0).first_step_bound_s(0.0, StartUp(seconds=12.0, compiles=True)) == 45.0
    assert default.explain(0.0, first_step=True, startup=StartUp(seconds=2.5)) == (
        "a first step's bound: 10 x the set-up's 2.50 s, at least 2 x stall_floor = 60 s"
    )
    clock = StepClock(StallRule(multiple=5.0, floor_s=3.0))
    clock.startup = StartUp(seconds=4.0)
    clock.step_starts(0.0, epoch=0, batch=0, batch_shape=(16, 4))
    assert clock.first_step and clock.bound_s == pytest.approx(20.0)


@pytest.mark.parametrize(
    "uneven",
    ["validation or a checkpoint", "a new epoch", "a batch of new shapes"],
)
def test_uneven_phases_get_the_first_step_bound_and_are_not_timed(uneven):
    """Each slow for a minute before the next step and in it (the epoch's first step starts the data loader's workers,
    the step after a checkpoint may page the model back in, new shapes recompile): validation and checkpoints are not
    bounded, the step after them gets the first step's bound, and none of it is timed."""
    clock, now = clock_after([1.0, 1.0, 0.2, 0.2])
    clock.step_starts(now, epoch=0, batch=4, batch_shape=(16, 4))
    assert clock.bound_s == 3.0
    epoch, shape, start = 0, (16, 4), now + 60.0
    if uneven == "validation or a checkpoint":
        clock.uneven_phase()  # between this step and the next
        assert clock.bound_s is None
    elif uneven == "a new epoch":
        epoch = 1
    else:  # the smaller last batch: new shapes (a recompilation, the BatchNorm check), slow in its own step only
        shape, start = (10, 4), now + 0.2
    clock.step_starts(start, epoch=epoch, batch=5, batch_shape=shape)
    assert clock.bound_s == RULE.first_step_s and clock.first_step, "the step after (or with) an uneven phase"
    clock.step_starts(start + 60.0, epoch=epoch, batch=6, batch_shape=shape)
    assert clock.bound_s == 3.0 and max(clock.durations) == pytest.approx(0.2), "the slow phase was timed"


def test_a_sharded_save_is_bounded_by_the_slowest_earlier_save_or_the_set_up_and_timed():
    """A sharded save's waits are bounded (a rank lost or stuck in it ends the run named), by a bound a legitimately
    long write stays under: every rank's save lasts as long as the slowest rank's write (it ends in collectives), so
    an earlier save measures it; before any, the set-up (which made the same weights real) stands in. A save is
    gathered in several calls (the module's state, each optimizer's, the write), timed from the first to its end.
    The first save, which nothing measured before, gets a first step's floor (a minute by default)."""
    clock, now = clock_after([1.0, 1.0, 0.2, 0.2])
    clock.startup = StartUp(seconds=2.0)
    clock.step_starts(now, epoch=0, batch=4, batch_shape=(16, 4))
    clock.step_ends()
    for call in range(3):  # the module's state, the optimizer's, the write
        clock.save_starts(now + 1.0 + call)
        assert clock.saving and not clock.first_step
        assert clock.bound_s == pytest.approx(5 * 2.0), "before any save: 5 x the set-up's 2 s, at least 2 x 3 s"
    assert clock.explain() == "a first checkpoint save's bound: 5 x the set-up's 2.00 s, at least 2 x stall_floor = 6 s"
    assert clock.where() == "while saving a checkpoint after batch 4 of epoch 0"
    clock.save_ends(now + 8.0)  # 7 s: longer than a regular step's bound, the set-up's multiple covered it
    assert clock.slowest_save_s == pytest.approx(7.0) and clock.bound_s == pytest.approx(10.0)
    clock.step_starts(now + 9.0, epoch=0, batch=5, batch_shape=(16, 4))
    assert clock.first_step and not clock.saving, "the step after a save is a first step"
    assert max(clock.durations) == pytest.approx(0.2), "the save was not timed as a step"
    clock.save_starts(now + 20.0)
    assert clock.bound_s == pytest.approx(5 * 7.0)  # from now on: the slowest earlier save's multiple
    assert clock.explain() == (
        "a checkpoint save's bound: 5 x the slowest earlier save (7.00 s), at least stall_floor = 3 s"
    )
    assert StallRule().save_bound_s(0.5, StartUp(seconds=2.0)) == 30.0  # the floor, as for a regular step
    assert StallRule().save_bound_s(None, StartUp(seconds=2.0)) == 60.0  # a first save: a minute by default
    assert StallRule().save_bound_s(None, StartUp(seconds=12.0)) == pytest.approx(120.0)  # a slow set-up: 10 x
    clock.uneven_phase()  # validation after it: unbounded again, and no longer a save
    assert clock.bound_s is None and not clock.saving


def test_a_rank_writing_its_part_of_a_sharded_save_waits_on_no_one():
    """Inside torch.distributed.checkpoint, only its collectives are waits on other ranks: a rank stuck writing its
    part is the one that stopped, not one more rank waiting (which would leave no one to name)."""
    torch_distributed = "/venv/torch/distributed/"
    save = [FrameSummary("/repo/lightning_pipe/checkpoints/commit.py", 70, "save_committed"),
            FrameSummary(torch_distributed + "checkpoint/state_dict_saver.py", 100, "save")]
    writing = save + [FrameSummary(torch_distributed + "checkpoint/filesystem.py", 300, "write_data"),
                      FrameSummary("/venv/torch/serialization.py", 900, "save")]
    assert main_thread_location(writing) == ("torch/serialization.py:900 in save", None)
    gathering = save + [FrameSummary(torch_distributed + "checkpoint/utils.py", 50, "gather_object"),
                        FrameSummary(torch_distributed + "distributed_c10d.py", 3000, "gather_object")]
    assert main_thread_location(gathering)[1] == (
        "torch.distributed.gather_object (called from checkpoints/commit.py:70 in save_committed)"
    )


def state(rank: int, waits_on: tuple[int, ...] = (), collective: str | None = None) -> RankState:
    waiting = f"for the activation of micro-batch 0 from rank {waits_on[0]}" if waits_on else None
    return RankState(rank, f"stage {2 - rank} (rank {rank})", waiting, list(waits_on), 4.0, f"train.py:{rank} in f",
                     collective, "in batch 3 of epoch 0", 0.1, 3.0, f"stall_stacks/rank{rank}.txt", "5 x 0.10 s")


def test_stopped_rank_is_the_awaited_one_that_waits_on_no_one():
    # A chain: rank 0 waits on rank 1, which waits on rank 2, which runs code of its own.
    assert stalled_ranks({0: state(0, (1,)), 1: state(1, (2,)), 2: state(2)}) == [2]
    # A rank computing legitimately that nobody waits on is not named.
    assert stalled_ranks({0: state(0, (1,)), 1: state(1), 2: state(2)}) == [1]
    # A rank that did not answer (stuck holding the interpreter, or gone) and is awaited.
    assert stalled_ranks({0: state(0, (1,)), 1: None, 2: state(2, (0,))}) == [1]
    # The others wait in a collective the pipeline did not make (Lightning's per-step broadcast): no one is named as
    # awaited, so the rank waiting on no one is.
    broadcast = "torch.distributed.broadcast (called from loops/training_epoch_loop.py:265)"
    assert stalled_ranks({0: state(0, collective=broadcast), 1: state(1), 2: state(2, collective=broadcast)}) == [1]
    # Every rank waits on another: a disagreement, no one to name.
    assert stalled_ranks({0: state(0, (1,)), 1: state(1, (0,))}) == []


def test_stall_message_names_the_wait_against_the_bound_and_the_rank_that_stopped():
    verdict = Verdict({0: state(0, (1,)), 1: state(1)}, [1], fired_by=0)
    waiting = stall_message(verdict.states[0], verdict, "run/stall_stacks")
    assert waiting.startswith(
        "stage 2 (rank 0) waited 4.0 s for the activation of micro-batch 0 from rank 1 in batch 3 of epoch 0."
    )
    assert "longer than its bound of 3.0 s (5 x 0.10 s); the last training step took 0.10 s." in waiting
    assert "The rank that stopped: stage 1 (rank 1) (awaited, and waiting on no other rank)." in waiting
    assert "  stage 1 (rank 1) waits on no other rank; no progress for 4.0 s, at train.py:1 in f" in waiting
    assert "Every rank's Python stack is in run/stall_stacks." in waiting
    stopped = stall_message(verdict.states[1], verdict, "run/stall_stacks")
    assert stopped.startswith("stage 1 (rank 1) stopped making progress in batch 3 of epoch 0 (at train.py:1 in f)")
    assert Wait("the gradients", (3,), sending=True).describe({3: "stage 0 (rank 3)"}) == (
        "for stage 0 (rank 3) to receive the gradients"
    )


# ---- stalls end the run, naming the rank that stopped ----------------------------------------------------------------

WATCHDOG = {"stall_floor": 3.0, "stall_multiple": 5.0}  # a wait in a regular step may last 3 s (steps take ~0.1 s)
# The stalls of regular steps keep their first steps' bound far above theirs: a loaded machine must not end those runs
# in a first step. The runs of the first step's rule derive it (at least 2 x the floor: 6 s).
REGULAR_STEPS_WATCHDOG = {**WATCHDOG, "stall_first_step": 60.0}
# The stalls, each where user code runs: a rank that sleeps inside its step (a pipelined layer of a middle stage, or the
# first stage's step before the pipelined call), a callback stuck at a batch's end (the other ranks then wait in
# Lightning's own per-step broadcast, which the pipeline does not make), and a training data loader that blocks.
STALLS = {
    "step": [fault("stall", "step", 0)],
    "callback": [fault("stall", "hook_end", 0)],
    "loader": [fault("stall", "loader", 0, batch=4)],  # batch 4 is read as step 3 starts
}
# CI's cases: every launcher and every kind of stall once, 3 stages once (the stopped stage in the middle).
CASES = {
    "popen-step-3-stages": ("gpipe", 3, [fault("stall", "layer", 1)]),
    "spawn-callback": ("gpipe_spawn", 2, STALLS["callback"]),
    "fork-loader": ("gpipe_fork", 2, STALLS["loader"]),
}
SLOW_CASES = {
    f"{launcher}-{kind}": (launcher, 2, faults)
    for launcher in ("gpipe", "gpipe_spawn", "gpipe_fork")
    for kind, faults in STALLS.items()
}
# A rank stuck in its run's first step (a deadlock of its own), under the default first-step rule (derived from the
# set-up's time, at least twice the floor: 6 s here, a minute by default): the run ends as after any stall, seconds
# after the bound, instead of after ten minutes (the former default) or the 30-minute timeout.
FIRST_STEP_STALL = ("gpipe", 2, [fault("stall", "step", 0, batch=0)])
# A data set whose first read in a process takes 8 s (it opens its files), longer than the first-step rule's floor
# (6 s): the set-up reads the first batch on rank 0 (the last stage), so rank 0's first read in the fit is quick and
# its first step waits for the first stage, whose first read comes in the fit. The set-up's time covers it.
SLOW_FIRST_BATCH_S = 8.0
SLOW_FIRST_BATCH = [{**fault("busy", "loader", stage, batch=0), "seconds": SLOW_FIRST_BATCH_S, "once": True}
                    for stage in (0, 1)]
# Legitimately slow phases, each sleeping twice the bound that would apply if it were a regular step's: the first step
# (on the first stage; 6 s, below its first-step bound of 20 s), a validation step (first stage), and a checkpoint's
# save (rank 0, the writer). Two epochs, a checkpoint every 4 steps.
SLOW_PHASES_WATCHDOG = {**WATCHDOG, "stall_first_step": 20.0}
SLOW_PHASES = [
    {**fault("slow", "step", 0, batch=0), "epoch": 0},
    {**fault("slow", "step", 0, "val", batch=2), "epoch": 0},
    {**fault("slow", "checkpoint", 1, batch=3), "epoch": 0},
]


# Stage 1 of 3 (rank 1) stuck in its callback's on_save_checkpoint during the second sharded save (a checkpoint every
# 2 steps): the others wait in the save (the save id's broadcast, torch.distributed.checkpoint's collectives), which
# the save's bound (5 x the first save's time, at least the floor) ends, naming it.
SHARDED_SAVE_STALL = ("gpipe", 3, [fault("stall", "checkpoint", 1)])


def run_sharded_save_stall(tmp_path: Path) -> FaultRun:
    launcher, devices, faults = SHARDED_SAVE_STALL
    return run_with_faults(tmp_path, devices, faults, launcher, watchdog=REGULAR_STEPS_WATCHDOG, checkpoint_every=2,
                           sharded_checkpoints=True)


def run_stall(case: tuple, tmp_path: Path, watchdog: dict = REGULAR_STEPS_WATCHDOG) -> FaultRun:
    launcher, devices, faults = case
    return run_with_faults(tmp_path, devices, faults, launcher, watchdog=watchdog)


def run_slow_phases(tmp_path: Path) -> FaultRun:
    return run_with_faults(tmp_path, 2, SLOW_PHASES, "gpipe", watchdog=SLOW_PHASES_WATCHDOG, epochs=2,
                           checkpoint_every=4)


@pytest.fixture(scope="module")
def pooled_stalls(tmp_path_factory) -> dict[str, FaultRun]:
    jobs = {name: partial(run_stall, case) for name, case in CASES.items()}
    jobs["slow-phases"] = run_slow_phases
    jobs["sharded-save"] = run_sharded_save_stall
    jobs["first-step"] = partial(run_stall, FIRST_STEP_STALL, watchdog=WATCHDOG)
    jobs["slow-first-batch"] = lambda tmp: run_with_faults(tmp, 2, SLOW_FIRST_BATCH, "gpipe", watchdog=WATCHDOG)
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {name: pool.submit(job, tmp_path_factory.mktemp(name)) for name, job in jobs.items()}
    runs = {name: future.result() for name, future in futures.items()}
    for name, run in runs.items():
        if run.faults:
            print(f"{name}: every process gone {run.seconds_to_exit:.1f} s after the stall")
    return runs


def check_stall_named(run: FaultRun, num_stages: int, faults: list[dict], bound_s: float = WATCHDOG["stall_floor"]) -> None:
    """Ended within the bound plus the time to end the processes, every process gone, every rank's error (on the
    terminal) naming the rank that stopped, every rank's stack in its log and in the run directory."""
    assert_ended_fast_everywhere(run)
    assert run.seconds_to_exit > bound_s, "the run ended before the bound: something else ended it"
    stage = faults[0]["stage"]
    rank = num_stages - 1 - stage  # the last stage is on global rank 0
    stopped = f"The rank that stopped: stage {stage} (rank {rank}) (awaited, and waiting on no other rank)."
    assert stopped in run.stderr, run.stderr[-6000:]
    assert "PipelineStallError" in run.stderr
    for name, end in run.ends.items():  # each rank that recorded its end (under spawn and fork: the launcher)
        assert end["ended"] == "PipelineStallError", f"{name}: {end['traceback']}"
        assert stopped in end["message"] and re.search(r"longer than its bound of [\d.]+ s", end["message"])
    stacks = run.out / "stall_stacks"
    for other in range(num_stages):
        header = f"Python stacks of stage {num_stages - 1 - other} (rank {other})"
        written = (stacks / f"rank{other}.txt").read_text()
        assert written.startswith(header) and "(most recent call first)" in written
        assert header in run.stderr, f"rank {other}'s stack is not in its log"
    # Where the stopped rank stopped: in the fault's sleep (the others' main threads never get there).
    assert [other for other in range(num_stages) if " in _fire\n" in (stacks / f"rank{other}.txt").read_text()] == [rank]


@pytest.mark.parametrize("name", CASES)
def test_stalled_rank_ends_the_run_named_with_every_stack(name, pooled_stalls):
    launcher, num_stages, faults = CASES[name]
    check_stall_named(pooled_stalls[name], num_stages, faults)


def test_callback_stall_is_found_while_the_others_wait_in_lightnings_broadcast(pooled_stalls):
    """The stopped rank's peer waits in Lightning's per-step broadcast, not in a wait of the pipeline: the watchdog
    still bounds it, and the table says where it waits."""
    run = pooled_stalls["spawn-callback"]
    assert re.search(r"stage 1 \(rank 0\) waited [\d.]+ s in torch\.distributed\.broadcast \(called from "
                     r"loops/training_epoch_loop\.py:\d+ in _broadcast_sigterm_tensor\)", run.stderr), run.stderr[-6000:]


def test_a_rank_stuck_in_a_sharded_save_ends_the_run_named_by_the_saves_bound(pooled_stalls):
    """A sharded save is bounded, not an unwatched phase: the run ends as after any stall, each rank's error naming
    the stuck stage, the bound derived from the first save's time, the ranks' waits inside the save in the table."""
    run = pooled_stalls["sharded-save"]
    check_stall_named(run, 3, SHARDED_SAVE_STALL[2])
    said = run.ends["rank0"]["message"]
    assert "stage 1 (rank 1) stopped making progress while saving a checkpoint after batch 3 of epoch 0" in run.stderr
    assert re.search(r"\(a checkpoint save's bound: 5 x the slowest earlier save \([\d.]+ s\), at least stall_floor"
                     r" = 3 s\)", said), said
    assert re.search(r"waited [\d.]+ s (for the checkpoint's save id|in torch\.distributed\.)", said), said
    assert [path.name for path in (run.out / "ckpt").glob("*.ckpt")] == ["epoch=0-step=2.ckpt"], "the first save"


def test_deadlocked_first_step_ends_the_run_named_within_seconds(pooled_stalls):
    """The run's very first step, which the regular bound does not cover, is bounded by the default first-step rule
    (stall_multiple x the set-up's time, at least 2 x stall_floor: 6 s here, a minute by default): the same report as
    any stall, every process gone seconds after the bound, well within two minutes."""
    run = pooled_stalls["first-step"]
    check_stall_named(run, 2, FIRST_STEP_STALL[2], bound_s=2 * WATCHDOG["stall_floor"])
    assert run.seconds_to_exit < 120
    assert "stage 0 (rank 1) stopped making progress in batch 0 of epoch 0" in run.stderr, run.stderr[-6000:]
    derived = r"\(a first step's bound: 5 x the set-up's ([\d.]+) s, at least 2 x stall_floor = 6 s\)"
    rule = re.search(derived, run.stderr)
    assert rule, run.stderr[-6000:]
    bound = re.search(r"longer than its bound of ([\d.]+) s", run.stderr)
    assert bound and float(bound.group(1)) == pytest.approx(max(6.0, 5 * float(rule.group(1))), abs=0.1)
    assert "raise GPipeStrategy(stall_first_step=...)" in run.stderr


def test_a_slow_loaders_first_batch_passes_the_first_step_rule_it_measured(pooled_stalls):
    """The first stage's first batch takes 8 s, longer than the rule's floor (6 s), while the last stage waits for it
    in its first step: the set-up took that long too (it read the first batch), so the derived bound covers it and
    the run finishes without the watchdog firing."""
    run = pooled_stalls["slow-first-batch"]
    assert run.returncode == 0 and not run.leftovers, run.stderr[-6000:]
    assert {name: end["ended"] for name, end in run.ends.items()} == {"rank0": "finished", "rank1": "finished"}
    assert not (run.out / "stall_stacks").exists(), "the watchdog fired"
    slow = json.loads((run.out / "busy-loader-1.json").read_text())  # the first stage's read, in the fit
    assert slow["seconds"] == SLOW_FIRST_BATCH_S > 2 * WATCHDOG["stall_floor"]
    assert slow["first_step_bound"] >= WATCHDOG["stall_multiple"] * SLOW_FIRST_BATCH_S


def test_slow_first_step_validation_and_checkpoint_do_not_trip_the_watchdog(pooled_stalls):
    run = pooled_stalls["slow-phases"]
    assert run.returncode == 0 and not run.leftovers, run.stderr[-6000:]
    assert {name: end["ended"] for name, end in run.ends.items()} == {"rank0": "finished", "rank1": "finished"}
    assert not (run.out / "stall_stacks").exists(), "the watchdog fired"
    slept = [json.loads(path.read_text()) for path in run.out.glob("slow-*.json")]
    assert sorted((s["where"], s["phase"]) for s in slept) == [("checkpoint", "train"), ("step", "train"),
                                                                 ("step", "val")]
    for slow in slept:  # each phase lasted longer than a wait may in a regular step
        assert slow["seconds"] >= 2 * slow["bound"] >= 2 * WATCHDOG["stall_floor"], slow
    # The slow first step is bounded, by the first step's bound, which it stays below.
    first = next(slow for slow in slept if slow["where"] == "step" and slow["phase"] == "train")
    assert first["seconds"] < SLOW_PHASES_WATCHDOG["stall_first_step"], first
    assert len(list((run.out / "ckpt").glob("*.ckpt"))) == 3  # steps 4, 8 and 12


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW_CASES)
def test_stall_matrix_ends_the_run_named_with_every_stack(name, tmp_path):
    run = run_stall(SLOW_CASES[name], tmp_path)
    print(f"{name}: every process gone {run.seconds_to_exit:.1f} s after the stall")
    check_stall_named(run, 2, SLOW_CASES[name][2])
