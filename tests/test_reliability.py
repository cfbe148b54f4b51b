"""A failing, killed or stalled rank ends the whole run within a minute, with its cause on the user's terminal and
no process left behind; a crash loses no training; misuse gets an error that names the stage and the fix; long
runs do not grow.

The multi-process cases launch ``workers/reliability_faults_worker.py`` and follow every process of the run through
``/proc``: each carries a unique marker in its environment, which the launchers (popen, spawn, fork, torchrun) pass on to
the ranks.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import seed_everything

from helpers.launch import REPO, WORKERS, Finished, launch, python_environment, run_python
from helpers.models import ProjectModule
from lightning_pipe import GPipeStrategy
from lightning_pipe.execution.engine import PipelineEngine
from lightning_pipe.execution.p2p import ACTIVATION, Header, TensorMeta, failed_wait
from lightning_pipe.execution.process_groups import PipelineGroups
from lightning_pipe.execution.runtime import StageRuntime
from lightning_pipe.execution.stage import StageBlocks
from lightning_pipe.partition.region import container_region
from lightning_pipe.partition.topology import PipelineLayout
from lightning_pipe.schedules.builtin import SCHEDULES

FAULT_TO_EXIT_LIMIT_S = 60  # the bound: every process gone this long after the fault
MARKER_VARIABLE = "LIGHTNING_PIPE_RELIABILITY_RUN"


def launch_marked(worker: str, spec: dict, tmp_path: Path, torchrun_processes: int | None = None) -> Finished:
    """Run ``workers/WORKER`` on ``spec`` (under torchrun with that many processes, if given) until every process
    it started has ended; the processes still alive at the deadline are killed then (and reported), so that a failing
    test leaves nothing behind. Its terminal output is in ``tmp_path/stderr.txt``."""
    # A launching process that the test signals starts fresh, as a user's would, not as a fork of the prestarted
    # Python.
    signalled = any(f["kind"].endswith("_launcher") for f in spec.get("faults", []))
    return launch(worker, spec, tmp_path, check=False, torchrun_processes=torchrun_processes,
                  marker_variable=MARKER_VARIABLE, prestarted=not signalled)


@dataclass
class FaultRun:
    """What a user sees after a run with a fault: exit status, terminal output, how fast every process was gone."""

    out: Path  # the worker's output directory
    returncode: int
    stderr: str
    ends: dict[str, dict]  # rank{R} / launcher -> how that process's script ended (missing: killed)
    faults: list[dict]  # the faults that fired, with their wall-clock time
    gone: float  # the wall-clock time when no process of the run was left
    leftovers: list[int] = field(default_factory=list)  # processes still alive at the deadline (then killed)

    @property
    def seconds_to_exit(self) -> float:
        """From the first fault until no process of the run was left."""
        return self.gone - self.faults[0]["time"] if self.faults else float("nan")


def run_with_faults(
    tmp_path: Path, devices: int, faults: list[dict], launcher: str = "gpipe", timeout_s: float | None = None,
    **spec_items,
) -> FaultRun:
    """Launch ``reliability_faults_worker.py`` under ``launcher`` (``gpipe``, ``gpipe_spawn``, ``gpipe_fork`` or
    ``torchrun``) and watch it end."""
    spec = {"devices": devices, "out": str(tmp_path), "faults": faults, "timeout_s": timeout_s,
            "strategy": launcher if launcher in ("gpipe_spawn", "gpipe_fork") else "gpipe", **spec_items}
    run = launch_marked("reliability_faults_worker.py", spec, tmp_path,
                        torchrun_processes=devices if launcher == "torchrun" else None)
    return collect(tmp_path, run.returncode, run.gone, run.leftovers)


def collect(out: Path, returncode: int, gone: float, leftovers: list[int], stderr: str | None = None) -> FaultRun:
    """A run's outcome from the files its processes wrote into ``out`` (and its terminal output)."""
    fired = sorted((json.loads(path.read_text()) for path in out.glob("fault*.json")), key=lambda f: f["time"])
    ends = {path.stem: json.loads(path.read_text()) for path in out.glob("*.json")
            if path.stem.startswith(("rank", "launcher"))}
    stderr = stderr if stderr is not None else (out / "stderr.txt").read_text()
    return FaultRun(out, returncode, stderr, ends, fired, gone, leftovers)


def assert_ended_fast_everywhere(run: FaultRun) -> None:
    assert run.faults, f"the fault never fired:\n{run.stderr[-4000:]}"
    took = run.seconds_to_exit
    assert not run.leftovers, f"processes {run.leftovers} were still running {took:.0f} s after the fault"
    assert took < FAULT_TO_EXIT_LIMIT_S, f"the run took {took:.0f} s to end after the fault"
    assert run.returncode != 0, "the launching process exited with status 0 after a fault"
    finished = [name for name, end in run.ends.items() if end["ended"] == "finished"]
    assert not finished, f"{finished} finished training although another rank failed"


def fault(kind: str, where: str, stage: int, phase: str = "train", batch: int = 3) -> dict:
    return {"kind": kind, "where": where, "stage": stage, "phase": phase, "batch": batch}


# ---- 1. failures surface fast; 2. stalls are caught -------------------------------------------------------------
# Under the default launcher the last stage is rank 0 (the launching process) and the first stage the highest rank.
# Under spawn and fork, every rank is a child of the launching process; under torchrun, of torchrun's agent.


@dataclass(frozen=True)
class Case:
    launcher: str
    devices: int
    faults: list[dict]
    spec: dict = field(default_factory=dict)  # more of the worker's spec (timeout_s, hidden_by_rank, runs)


STALL_TIMEOUT_S = 20  # GPipeStrategy(timeout=...) of the stall case; it also bounds the ranks' start-up
FAILURES = {
    # A child rank (stage 1 of 3) raises inside a pipelined layer: rank 0, waiting on it, re-raises its exception.
    "popen-middle-layer-train": Case("gpipe", 3, [fault("raise", "layer", 1)]),
    # The same while the launching process (rank 0, the last stage) is busy for 10 s before it next waits on the
    # failed rank: Lightning's child-process observer (every 5 s) must not SIGKILL it before it says the cause.
    "popen-first-layer-train-launcher-busy": Case(
        "gpipe", 2, [fault("raise", "layer", 0), {**fault("busy", "hook", 1), "seconds": 10}]
    ),
    # Rank 0 raises in validation while the other rank computes outside any communication (here: sleeps in a
    # callback): nothing would ever stop that rank, so the launching process ends it as it exits.
    "popen-last-hook-val-other-stuck": Case(
        "gpipe", 2, [fault("raise", "hook", 1, "val"), fault("stall", "hook", 0, "val")]
    ),
    # Under spawn, torch sends SIGTERM to the other ranks; they must end without its SIGKILL 30 s later.
    "spawn-first-step-val": Case("gpipe_spawn", 3, [fault("raise", "step", 0, "val")]),
    "torchrun-last-step-train": Case("torchrun", 2, [fault("raise", "step", 1)]),
    # Under fork, as under spawn: the ranks are children that torch ends with SIGTERM.
    "fork-first-layer-train": Case("gpipe_fork", 2, [fault("raise", "layer", 0)]),
}
# A child rank SIGKILLed inside a pipelined layer of the first stage, in epoch 2 of 3 (with a last checkpoint at
# every epoch end): section 3 resumes this run.
CRASH = {"devices": 2, "epochs": 3, "mode": "crash", "kill": {"epoch": 2, "batch": 1}}
CRASH_FAULTS = [fault("sigkill", "layer", 0)]
# Stage 0 of 2 (rank 1) stops making progress in its layer without failing: with the stall watchdog off
# (test_stall_watchdog.py has it on), stage 1's wait times out. (The spawn launcher starts every rank at once, so the
# short timeout is not spent waiting for ranks to start.)
STALL = Case("gpipe_spawn", 2, [fault("stall", "layer", 0)], {"timeout_s": STALL_TIMEOUT_S, "watchdog": False})
# Misuse (section 4), 2 stages. Fits that end alike on every rank (NaN trains on; different models fail at setup)
# run first in one launch; a misuse that fails one stage mid-step ends its launch.
MISUSES = {
    "nan-loss": {"faults": [fault("nan", "layer", 0, batch=2)]},
    "different-models": {"hidden_by_rank": {"1": 24}},
    "batch-dim": {"faults": [fault("batch_dim", "layer", 0)]},
    "dtype": {"faults": [fault("dtype", "layer", 0)]},
    "non-tensor": {"faults": [fault("non_tensor", "layer", 0)]},
    "different-paths": {"faults": [fault("skip", "step", 0)]},
}
MISUSE_LAUNCHES = [["nan-loss", "different-models", "batch-dim"], ["dtype"]]
# SIGTERM (a scheduler, `kill`) or SIGINT (`kill -INT`) to the launching process (rank 0, the last stage) while the first
# stage (rank 1) is stuck in its step, so that rank 0 is blocked in gloo's untimed wait for its activation: every
# process must be gone within SIGNAL_TO_EXIT_LIMIT_S. The stuck rank sends the signal to its parent itself.
SIGNAL_TO_EXIT_LIMIT_S = 10
SIGNALS = {
    "sigterm-while-blocked": Case("gpipe", 2, [fault("sigterm_launcher", "step", 0)]),
    "sigint-while-blocked": Case("gpipe", 2, [fault("sigint_launcher", "step", 0)]),
}
SLOW_MISUSES = ["non-tensor", "different-paths"]  # the same checks as batch-dim (non-tensor) and an older error

# The whole matrix: every place user code runs, in training and validation, raised or killed, under each launcher.
SLOW_CASES = {
    f"{launcher}-{kind}-{where}-stage{stage}-{phase}": Case(launcher, 3, [fault(kind, where, stage, phase)])
    for launcher in ("gpipe", "gpipe_spawn", "torchrun")
    for kind in ("raise", "sigkill")
    for where, stage in (("step", 0), ("step", 2), ("layer", 0), ("layer", 1), ("layer", 2))
    for phase in ("train", "val")
}


def run_case(case: Case, tmp_path: Path) -> FaultRun:
    return run_with_faults(tmp_path, case.devices, case.faults, case.launcher, **case.spec)


def run_misuses(names: list[str], tmp_path: Path) -> dict[str, FaultRun]:
    """The misuse fits ``names`` in turn in one 2-stage launch; each fit's outcome from its own directory."""
    runs = [{"name": name, "faults": [], **MISUSES[name]} for name in names]
    launch = run_case(Case("gpipe", 2, [], {"runs": runs}), tmp_path)
    return {name: collect(tmp_path / name, launch.returncode, launch.gone, launch.leftovers, launch.stderr)
            for name in names}


def run_crash_then_resume(tmp_path: Path) -> FaultRun:
    """The crash, then (once every process of it is gone, and if it left a checkpoint) the rerun from last.ckpt."""
    run = launch_marked("reliability_crash_worker.py", {**CRASH, "out": str(tmp_path)}, tmp_path)
    crash = collect(tmp_path, run.returncode, run.gone, run.leftovers)
    if (tmp_path / "ckpt" / "last.ckpt").exists():
        last = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)  # before the rerun writes its own
        (tmp_path / "last_after_crash.json").write_text(json.dumps([last["epoch"], last["global_step"]]))
        launch("reliability_crash_worker.py", {**CRASH, "out": str(tmp_path), "mode": "resume"}, tmp_path / "resume")
    return crash


@pytest.fixture(scope="module")
def pooled_runs(tmp_path_factory) -> dict[str, FaultRun]:
    """Every fast multi-process run of this file, four launches at a time (the longest first): most of a launch is
    start-up, and the waits of one (a timeout, a launcher's polling) overlap the start-up of others."""
    jobs: dict[str, Callable[[Path], Any]] = {"stall": partial(run_case, STALL), "crash": run_crash_then_resume}
    jobs["soak"] = run_short_soak
    jobs.update({name: partial(run_case, case) for name, case in FAILURES.items()})
    jobs.update({name: partial(run_case, case) for name, case in SIGNALS.items()})
    jobs["slurm-requeue"] = run_as_slurm_job
    misuse_launches = {"+".join(names): partial(run_misuses, names) for names in MISUSE_LAUNCHES}
    jobs.update(misuse_launches)
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {
            name: pool.submit(job, tmp_path_factory.mktemp(name.replace("+", "_"))) for name, job in jobs.items()
        }
    runs: dict[str, Any] = {}
    for name, future in futures.items():
        runs.update(future.result() if name in misuse_launches else {name: future.result()})  # misuses: one per fit
    for name, run in runs.items():
        if isinstance(run, FaultRun) and run.faults:
            print(f"{name}: every process gone {run.seconds_to_exit:.1f} s after the fault")
    return runs


def check_failure_surfaced(run: FaultRun, faults: list[dict]) -> None:
    assert_ended_fast_everywhere(run)
    assert "forcefully exiting via SIGKILL" not in run.stderr, "a rank ignored the spawn launcher's SIGTERM"
    first = next(f for f in faults if f["kind"] != "stall")
    if first["kind"] == "raise":
        # The user's exception, type and message, is on the terminal (not only a peer's "connection closed").
        expected = f"InjectedFault: injected fault in {first['where']} on stage {first['stage']} at {first['phase']}"
        assert expected in run.stderr, run.stderr[-6000:]
        if first["where"] == "layer":  # the note the engine adds: where in the pipeline it happened
            assert f"raised by pipeline stage {first['stage']} (blocks" in run.stderr, run.stderr[-6000:]
        check_every_rank_ended_with_the_cause(run, expected)
    else:
        killed = f"stage {first['stage']} \\(rank \\d\\)"
        said = [rf"lost {killed}", r"terminated with signal SIGKILL", r"Signal 9 \(SIGKILL\)", r"exitcode\s*:\s*-9"]
        assert any(re.search(pattern, run.stderr) for pattern in said), run.stderr[-6000:]


def check_every_rank_ended_with_the_cause(run: FaultRun, expected: str) -> None:
    """The launching process's final error, and that of every rank that got to record its end, is the user's
    exception (re-raised by the ranks that lost the stage which raised it), not a lost-peer error."""
    launching = "launcher" if "launcher" in run.ends else "rank0"
    assert launching in run.ends, f"the launching process (or rank 0 under torchrun) recorded no end: {run.ends}"
    for name, end in run.ends.items():  # under spawn, the launcher raises the rank's exception, not torch's text
        assert end["ended"] == "InjectedFault", f"{name} ended with {end['ended']}: {end['traceback']}"
        assert expected.removeprefix("InjectedFault: ") in end["message"], end["message"]
    rank0, stage = run.ends.get("rank0", {}).get("traceback", ""), re.search(r"on stage (\d+)", expected)
    if "then lost that stage" in rank0:  # rank 0 lost the stage that raised: its error says where it came from
        said = rf"raised on stage {stage.group(1) if stage else '?'} \(rank [1-9]\); stage \d \(rank 0\) then lost"
        assert re.search(said, rank0), rank0


def test_killed_rank_ends_every_process_fast_and_is_named(pooled_runs):
    check_failure_surfaced(pooled_runs["crash"], CRASH_FAULTS)


@pytest.mark.parametrize("name", FAILURES)
def test_failure_ends_every_process_fast_with_its_cause(name, pooled_runs):
    check_failure_surfaced(pooled_runs[name], FAILURES[name].faults)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW_CASES))
def test_failure_matrix_ends_every_process_fast_with_its_cause(name, tmp_path):
    run = run_case(SLOW_CASES[name], tmp_path)
    print(f"{name}: every process gone {run.seconds_to_exit:.1f} s after the fault")
    check_failure_surfaced(run, SLOW_CASES[name].faults)


@pytest.mark.slow
def test_stalled_stage_of_a_replicated_pipeline_is_caught_by_the_timeout(tmp_path):
    """2 stages x 2 replicas: the pipelines' own groups have the timeout too (not only the world's)."""
    stall = [fault("stall", "layer", 0, batch=1)]  # each replica reads 3 of the 6 batches
    run = run_case(Case("gpipe_spawn", 4, stall, {**STALL.spec, "num_stages": 2}), tmp_path)
    assert_ended_fast_everywhere(run)
    waited = rf"stage 1 \(rank \d\) timed out after {STALL_TIMEOUT_S} s waiting for the activation of micro-batch 0"
    assert re.search(waited, run.stderr), run.stderr[-6000:]


@pytest.mark.slow
def test_sigterm_to_the_launching_process_stops_every_rank_at_the_next_step(tmp_path):
    """`kill <pid>` (or a scheduler's SIGTERM) to rank 0 under the default launcher: Lightning passes it to the ranks
    it started and stops every rank at the next training step (without a broadcast inside the signal handler), with
    Lightning's SIGTERMException (a SystemExit: exit status 0, as Lightning does on one device)."""
    run = run_case(Case("gpipe", 2, [fault("sigterm", "hook", 1)]), tmp_path)
    assert not run.leftovers and run.seconds_to_exit < FAULT_TO_EXIT_LIMIT_S
    assert {name: end["ended"] for name, end in run.ends.items()} == {
        "rank0": "SIGTERMException", "rank1": "SIGTERMException"
    }, run.stderr[-6000:]


# SIGINT reaches a launch only where the tests' process does not ignore it (tests/conftest.py makes sure).
@pytest.mark.parametrize("name", SIGNALS)
def test_stop_signal_to_the_launching_process_ends_every_rank_even_one_blocked_in_a_wait(name, pooled_runs):
    """Rank 0 cannot run a Python signal handler while blocked in the wait; its thread hears the signal, passes it on to
    the rank it started, and after 1 s closes its connections: rank 0 ends through Lightning's handling with the
    signal's exception, the stuck rank is ended, nothing is left."""
    run = pooled_runs[name]
    assert run.faults, f"the signal was never sent:\n{run.stderr[-4000:]}"
    took = run.seconds_to_exit
    assert not run.leftovers, f"processes {run.leftovers} were still running {took:.0f} s after the signal"
    assert took < SIGNAL_TO_EXIT_LIMIT_S, (
        f"every process was gone only {took:.1f} s after the signal:\n{run.stderr[-6000:]}")
    assert "finished" not in {end["ended"] for end in run.ends.values()}, run.ends
    if name.startswith("sigterm"):  # Lightning's exception for SIGTERM on rank 0 (a SystemExit: exit status 0)
        assert run.ends["rank0"]["ended"] == "SIGTERMException", run.stderr[-6000:]
    else:  # KeyboardInterrupt, which Lightning ends with sys.exit(1)
        assert run.ends["rank0"]["ended"] == "SystemExit" and run.returncode == 1, run.stderr[-6000:]
        assert "Detected KeyboardInterrupt, attempting graceful shutdown" in run.stderr


SLURM_JOB_ID = "4242"
SLURM_RUN_TIMEOUT_S = 240


def run_as_slurm_job(tmp_path: Path) -> dict:
    """Start both ranks of a 2-stage fit as SLURM's srun would (one process per rank, SLURM_* variables, Lightning's
    SLURMEnvironment with auto-requeue); the first stage's rank sends SIGUSR1 to both ranks at batch 2, as SLURM does
    before the time limit. A script named ``scontrol`` first on PATH records its arguments (SLURM cannot run here)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    scontrol = bin_dir / "scontrol"
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path / "scontrol_calls.txt"}\n')
    scontrol.chmod(0o755)
    spec = {"devices": 2, "out": str(tmp_path), "faults": [fault("sigusr1_all", "hook", 0, batch=2)], "timeout_s": None}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    slurm = {"SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "1", "SLURM_NODEID": "0",
             "SLURM_JOB_ID": SLURM_JOB_ID, "SLURM_JOB_NAME": "train", "SLURM_NODELIST": "localhost",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    processes = []
    for rank in range(2):
        environment = python_environment({**slurm, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)})
        log = open(tmp_path / f"rank{rank}.log", "w")
        processes.append(subprocess.Popen(
            [sys.executable, str(WORKERS / "reliability_faults_worker.py"), str(tmp_path / "spec.json")],
            cwd=tmp_path, env=environment, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        ))
    deadline = time.monotonic() + SLURM_RUN_TIMEOUT_S
    codes = []
    for process in processes:
        try:
            codes.append(process.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            codes.append(process.wait())
    calls = tmp_path / "scontrol_calls.txt"
    return {"out": tmp_path, "returncodes": codes, "scontrol": calls.read_text().splitlines() if calls.exists() else [],
            "log": "".join((tmp_path / f"rank{rank}.log").read_text() for rank in range(2))}


def test_slurm_auto_requeue_saves_a_checkpoint_and_requeues_the_job(pooled_runs):
    """SIGUSR1 reaches every rank mid-run (while the other rank waits on the one that got it first): every rank takes
    part in the hpc checkpoint, global rank 0 calls `scontrol requeue JOB_ID` once, and the run goes on to its end
    (SLURM's SIGTERM ends it later)."""
    run = pooled_runs["slurm-requeue"]
    assert run["returncodes"] == [0, 0], run["log"][-6000:]
    ends = {rank: json.loads((run["out"] / f"rank{rank}.json").read_text())["ended"] for rank in range(2)}
    assert ends == {0: "finished", 1: "finished"}, run["log"][-6000:]
    assert run["scontrol"] == [f"requeue {SLURM_JOB_ID}"]
    saved = torch.load(run["out"] / "hpc_ckpt_1.ckpt", weights_only=False)
    seed_everything(0)
    from workers.reliability_faults_worker import Faults, FaultyModel

    whole = FaultyModel(2, Faults([], None)).state_dict()
    assert saved["state_dict"].keys() == whole.keys(), "the hpc checkpoint does not hold the whole model"
    # Rank 1 signals as its step 2 starts, rank 0 then counts it in step 2 (or at the end of step 1, after sharing its
    # outcome): step 2's outcome tells the pipeline, and every stage requeues as step 3 starts.
    assert saved["global_step"] == 3, saved["global_step"]


def test_stalled_stage_is_caught_by_the_timeout_and_named(pooled_runs):
    """The error says which stage waited for which, and for what (stage 0, rank 1, stalled in its layer)."""
    run = pooled_runs["stall"]
    assert_ended_fast_everywhere(run)
    assert run.seconds_to_exit > STALL_TIMEOUT_S, "the run ended before the timeout: something else ended it"
    waited = (
        f"PipelineCommunicationError: stage 1 (rank 0) timed out after {STALL_TIMEOUT_S} s waiting for the activation"
        " of micro-batch 0 from stage 0 (rank 1)"
    )
    assert waited in run.stderr, run.stderr[-6000:]


@pytest.mark.parametrize(
    ("gloo_says", "expected"),
    [
        ("[unbound_buffer.cc:78] Timed out waiting 10000ms for recv operation to complete", "timed out after 10 s"),
        ("Application timeout caused pair closure", "timed out after 10 s"),
        ("[pair.cc:553] Connection closed by peer [127.0.0.1]:12458", "lost stage 0 (rank 1) while"),
        ("[pair.cc:537] Read error [127.0.0.1]:7307: Connection reset by peer", "lost stage 0 (rank 1) while"),
        ("Message size mismatch", "failed waiting for the activation of micro-batch 2 from stage 0 (rank 1)"),
    ],
    ids=["timeout", "after-timeout", "closed", "reset", "other"],
)
def test_failed_wait_says_who_waited_for_whom_and_why(gloo_says, expected):
    """The messages gloo gives on a timeout and on a lost peer (as seen in the runs above), and any other."""
    waited = "waiting for the activation of micro-batch 2 from stage 0 (rank 1)"
    error = failed_wait("stage 1 (rank 0)", waited, "stage 0 (rank 1)", timedelta(seconds=10), RuntimeError(gloo_says))
    assert str(error).startswith("stage 1 (rank 0) ") and expected in str(error)


# ---- 3. nothing lost on a crash -------------------------------------------------------------------------------------


def relative_change_error(initial: dict, expected: dict, actual: dict) -> float:
    """|actual - expected| / |expected - initial| over the floating-point tensors of a state dict."""
    keys = [key for key, value in expected.items() if value.is_floating_point()]
    error = sum(float(((actual[key] - expected[key]) ** 2).sum()) for key in keys) ** 0.5
    change = sum(float(((expected[key] - initial[key]) ** 2).sum()) for key in keys) ** 0.5
    assert change > 1e-2, "training barely changed the weights"
    return error / change


def test_run_killed_mid_epoch_resumes_from_last_as_uninterrupted_training(pooled_runs):
    """3 epochs on 2 stages, a last checkpoint at each epoch end; the first stage's rank is SIGKILLed mid-step at
    batch 1 of epoch 2. Rerun with ckpt_path="last": the final weights are those of the same training uninterrupted.
    (The rerun reads last.ckpt as the crash left it: it ran once every process of the crash was gone.)"""
    out = pooled_runs["crash"].out
    last = json.loads((out / "last_after_crash.json").read_text())
    assert last == [1, 8], f"the crash left the checkpoint of epoch {last[0]} step {last[1]}, not the end of epoch 1"
    seed_everything(0)
    initial = ProjectModule(scheduler="epoch").state_dict()
    for rank in range(2):
        result = torch.load(out / f"rank{rank}.pt")
        error = relative_change_error(initial, result["uninterrupted"], result["resumed"])
        print(f"rank {rank}: resumed weights differ from uninterrupted training by {error:.1e} of their change")
        assert error < 1e-6, f"rank {rank}: the resumed weights differ by {error:.1e} of their change"


def test_crash_while_writing_a_checkpoint_leaves_the_previous_one(tmp_path):
    """The strategy writes consolidated checkpoints through its checkpoint IO (Lightning's, atomic: into a temporary
    file, renamed when complete). A process killed half-way through writing leaves the previous file intact."""
    io = GPipeStrategy().checkpoint_io
    path = tmp_path / "last.ckpt"
    previous = {"state_dict": {"w": torch.arange(4.0)}, "epoch": 1}
    io.save_checkpoint(previous, path)

    child = os.fork()
    if child == 0:  # the writer: killed after writing half of the next checkpoint's bytes
        import fsspec.implementations.local as local

        def write_half_then_die(self, data):
            self.f.write(data[: len(data) // 2])
            self.f.flush()
            os.kill(os.getpid(), signal.SIGKILL)

        local.LocalFileOpener.write = write_half_then_die
        io.save_checkpoint({"state_dict": {"w": torch.zeros(10_000)}, "epoch": 2}, path)
        os._exit(0)  # not reached
    _, status = os.waitpid(child, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, "the writer was not killed mid-write"
    loaded = io.load_checkpoint(path)
    assert loaded["epoch"] == 1 and torch.equal(loaded["state_dict"]["w"], previous["state_dict"]["w"])


# ---- 4. misuse gets an error naming the stage, the micro-batch and the fix (the catalogue: docs/errors.md) ---------
# Under the default launcher with 2 stages: stage 0 is rank 1, stage 1 is rank 0.

MISUSE_ERRORS = {
    "non-tensor": (
        "TypeError: the output of model chunk 0 for micro-batch 0 is a dict (item 0); only a tensor or a tuple of"
        " tensors can flow between pipeline stages"
    ),
    "batch-dim": (
        "ValueError: pipeline stage 0 turned micro-batch 0 of 4 samples into an output whose item 0 has shape"
        " (1, 16); the pipeline joins the stages' outputs along dim 0"
    ),
    "dtype": (
        "raised by pipeline stage 1 (blocks 2..3) on micro-batch 0 of 4; it received torch.float64 from stage 0 but"
        " its parameters are torch.float32: give every stage the same dtype"
    ),
    "different-paths": (
        "PipelineMismatchError: the last stage called the pipelined module in this step but the first stage's step"
        " returned before calling it; the step must take the same path on every stage"
    ),
    "different-models": (
        "ValueError: the ranks built different models: 'layers.0.weight' is float32 of shape (24, 12) on rank 1"
        " (stage 0) but float32 of shape (16, 12) on rank 0 (stage 1)"
    ),
}


def check_misuse_error(name: str, run: FaultRun) -> None:
    assert run.returncode != 0 and not run.leftovers
    # On the terminal; or, for a fit that failed on every rank and was followed by another, in the ranks' records.
    said = run.stderr + "".join(end.get("traceback", "") for end in run.ends.values())
    assert MISUSE_ERRORS[name] in said, said[-6000:]
    assert any(end["ended"] != "finished" for end in run.ends.values()), f"{name}: every rank finished"


@pytest.mark.parametrize("name", [name for name in MISUSE_ERRORS if name not in SLOW_MISUSES])
def test_misuse_error_names_the_stage_and_the_fix(name, pooled_runs):
    check_misuse_error(name, pooled_runs[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW_MISUSES)
def test_more_misuse_errors_name_the_stage_and_the_fix(name, tmp_path):
    check_misuse_error(name, run_misuses([name], tmp_path)[name])


def test_nan_loss_trains_on_as_on_one_device(pooled_runs):
    """A layer's output turns NaN at batch 2: as on one device, training goes on (no error, no hang), every rank
    logs the same losses as one device, NaN from batch 2, and the weights end as one device's (NaN included)."""
    from workers.reliability_faults_worker import Faults, fit

    run = pooled_runs["nan-loss"]
    model, _, expected_losses = fit(2, Faults(MISUSES["nan-loss"]["faults"], None))
    assert all(math.isnan(loss) for loss in expected_losses[2:]) and not math.isnan(expected_losses[1])
    merged: dict[str, torch.Tensor] = {}
    for rank in (0, 1):
        assert run.ends[f"rank{rank}"]["ended"] == "finished"
        losses = run.ends[f"rank{rank}"]["losses"]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected_losses), equal_nan=True)
        merged.update(torch.load(run.out / f"rank{rank}.pt"))
    expected = model.state_dict()
    assert merged.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(merged[key], value, equal_nan=True)


def test_pipelined_module_called_twice_in_a_step_names_the_fix():
    """One pipelined call per step (checked on every stage before anything is sent; here on a single stage)."""
    model = torch.nn.Module()
    model.layers = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    stage = StageBlocks(model, container_region(model, "layers"), range(2), stage_index=0, num_stages=1)
    stage.install()
    engine = PipelineEngine(stage, 2, "never", links={}, schedule=SCHEDULES["gpipe"])
    alone = PipelineGroups(PipelineLayout(1), 0, torch.device("cpu"), None, None, None, None)  # no process groups
    runtime = StageRuntime(alone, engine, stage)

    def step_calling_twice():
        model.layers(torch.zeros(4, 4))
        model.layers(torch.zeros(4, 4))

    with pytest.raises(RuntimeError, match="called twice in one step; .* Call it once \\(concatenate inputs"):
        runtime.forward_step(step_calling_twice)


def test_tensor_dtype_that_cannot_travel_names_the_fix():
    header = Header(ACTIVATION, 0, 1, (TensorMeta((2, 3), torch.float8_e4m3fn, False),))
    with pytest.raises(TypeError, match="dtype torch.float8_e4m3fn between pipeline stages; .* convert it"):
        header.encode()


def test_activation_too_large_for_the_header_names_the_fix():
    metas = tuple(TensorMeta((2, 3, 4, 5), torch.float32, True) for _ in range(10))
    with pytest.raises(ValueError, match="does not fit the 64-entry message header; pass fewer or lower-dimensional"):
        Header(ACTIVATION, 0, 1, metas).encode()


# ---- 5. soak --------------------------------------------------------------------------------------------------------


def run_short_soak(tmp_path: Path) -> dict:
    """``benchmarks/soak.py`` at 200 steps on 2 stages (the recorded run: 2,000 on 4, in docs/reliability.md)."""
    result = run_python(REPO / "benchmarks" / "soak.py", "--steps", "200", "--stages", "2",
                        "--json", tmp_path / "soak.json", cwd=tmp_path, check=False)
    assert (tmp_path / "soak.json").exists(), result.stderr[-6000:]
    return {"returncode": result.returncode, **json.loads((tmp_path / "soak.json").read_text())}


def test_short_soak_keeps_memory_threads_and_open_files_flat(pooled_runs):
    soak = pooled_runs["soak"]
    for rank in soak["ranks"]:
        first, last = rank["samples"][str(soak["reference_step"])], rank["samples"]["200"]
        print(f"rank {rank['rank']}: RSS {first['rss_bytes'] / 2**20:.1f} -> {last['rss_bytes'] / 2**20:.1f} MiB")
        grew = rank["rss_growth"]
        assert last["rss_bytes"] <= 1.05 * first["rss_bytes"], f"rank {rank['rank']}: memory grew {grew:.1%}"
        assert last["threads"] <= first["threads"] and last["open_files"] <= first["open_files"], rank
    assert soak["holds"] and soak["returncode"] == 0
