"""A failing, killed or stalled rank ends the whole run within a minute, with its cause on the user's terminal and
no process left behind; a crash loses no training; misuse gets an error that names the stage and the fix; long
runs do not grow.

The multi-process cases launch ``workers/fault_runs.py`` and follow every process of the run through ``/proc``: each
carries a unique marker in its environment, which the launchers (popen, spawn, torchrun) pass on to the ranks.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from helpers.compare import REPO, WORKERS

FAULT_TO_EXIT_LIMIT_S = 60  # the bound: every process gone this long after the fault
MARKER_VARIABLE = "LIGHTNING_PIPE_RELIABILITY_RUN"


def marked_processes(marker: str) -> list[int]:
    """Pids of the live processes whose environment carries ``marker`` (zombies have an empty environment)."""
    needle = f"{MARKER_VARIABLE}={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                environment = Path(f"/proc/{entry}/environ").read_bytes()
            except OSError:  # gone meanwhile, or not ours
                continue
            if needle in environment.split(b"\0"):
                found.append(int(entry))
    return found


@dataclass
class FaultRun:
    """What a user sees after a run with a fault: exit status, terminal output, how fast every process was gone."""

    returncode: int
    stderr: str
    ends: dict[str, dict]  # rank{R} / launcher -> how that process's script ended (missing: killed)
    faults: list[dict]  # the faults that fired, with their wall-clock time
    seconds_to_exit: float  # from the first fault until no process of the run was left
    leftovers: list[int] = field(default_factory=list)  # processes still alive at the deadline (then killed)


def run_with_faults(
    tmp_path: Path, devices: int, faults: list[dict], launcher: str = "gpipe", timeout_s: float | None = None,
    deadline_s: float = 300,
) -> FaultRun:
    """Launch ``fault_runs.py`` under ``launcher`` (``gpipe``, ``gpipe_spawn`` or ``torchrun``) and watch it end."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    spec = {"devices": devices, "out": str(tmp_path), "faults": faults, "timeout_s": timeout_s,
            "strategy": "gpipe_spawn" if launcher == "gpipe_spawn" else "gpipe"}
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    marker = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", MARKER_VARIABLE: marker}
    for variable in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RANK"):
        env.pop(variable, None)
    command = [sys.executable, str(WORKERS / "fault_runs.py"), str(spec_path)]
    if launcher == "torchrun":
        command[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={devices}"]
    with open(tmp_path / "stderr.txt", "w") as stderr, open(tmp_path / "stdout.txt", "w") as stdout:
        process = subprocess.Popen(command, stdout=stdout, stderr=stderr, env=env, cwd=tmp_path, start_new_session=True)
        started = time.monotonic()
        while (marked_processes(marker) or process.poll() is None) and time.monotonic() - started < deadline_s:
            time.sleep(0.1)
        gone = time.time()
        leftovers = marked_processes(marker)
        for pid in leftovers:  # the run's own processes: end them so that a failing test leaves nothing behind
            os.kill(pid, signal.SIGKILL)
        returncode = process.wait()
    fired = sorted((json.loads(path.read_text()) for path in tmp_path.glob("fault*.json")), key=lambda f: f["time"])
    ends = {path.stem: json.loads(path.read_text()) for path in tmp_path.glob("*.json")
            if path.stem.startswith(("rank", "launcher"))}
    return FaultRun(returncode, (tmp_path / "stderr.txt").read_text(), ends, fired,
                    gone - fired[0]["time"] if fired else float("nan"), leftovers)


def assert_ended_fast_everywhere(run: FaultRun) -> None:
    assert run.faults, f"the fault never fired:\n{run.stderr[-4000:]}"
    assert not run.leftovers, f"processes {run.leftovers} were still running {run.seconds_to_exit:.0f} s after the fault"
    assert run.seconds_to_exit < FAULT_TO_EXIT_LIMIT_S, f"the run took {run.seconds_to_exit:.0f} s to end after the fault"
    assert run.returncode != 0, "the launching process exited with status 0 after a fault"
    finished = [name for name, end in run.ends.items() if end["ended"] == "finished"]
    assert not finished, f"{finished} finished training although another rank failed"


def fault(kind: str, where: str, stage: int, phase: str = "train", batch: int = 3) -> dict:
    return {"kind": kind, "where": where, "stage": stage, "phase": phase, "batch": batch}


# ---- 1. failures surface fast; 2. stalls are caught -------------------------------------------------------------
# Under the default launcher the last stage is rank 0 (the launching process) and the first stage the highest rank.
# Under spawn, every rank is a child of the launching process; under torchrun, of torchrun's agent.

STALL_TIMEOUT_S = 20  # GPipeStrategy(timeout=...) of the stall case; it also bounds the ranks' start-up
FAST_CASES = {
    # A child rank (stage 1 of 3) raises inside a pipelined layer: Lightning's observer ends rank 0.
    "popen-middle-layer-train": ("gpipe", 3, [fault("raise", "layer", 1)], None),
    # A child rank is killed mid-step: the others lose it and end.
    "popen-first-layer-sigkill": ("gpipe", 2, [fault("sigkill", "layer", 0)], None),
    # Rank 0 raises in validation while the other rank computes outside any communication (here: sleeps in a
    # callback): nothing would ever stop that rank, so the launching process ends it as it exits.
    "popen-last-hook-val-other-stuck": ("gpipe", 2, [fault("raise", "hook", 1, "val"), fault("stall", "hook", 0, "val")], None),
    "spawn-first-step-val": ("gpipe_spawn", 2, [fault("raise", "step", 0, "val")], None),
    "torchrun-last-step-train": ("torchrun", 3, [fault("raise", "step", 2)], None),
    # Stage 1 of 3 stops making progress in its layer without failing: the neighbours' waits time out. (The spawn
    # launcher starts every rank at once, so the short timeout is not spent waiting for ranks to start.)
    "spawn-middle-layer-stall": ("gpipe_spawn", 3, [fault("stall", "layer", 1)], STALL_TIMEOUT_S),
}

# The whole matrix: every place user code runs, in training and validation, raised or killed, under each launcher.
SLOW_CASES = {
    f"{launcher}-{kind}-{where}-stage{stage}-{phase}": (launcher, 3, [fault(kind, where, stage, phase)], None)
    for launcher in ("gpipe", "gpipe_spawn", "torchrun")
    for kind in ("raise", "sigkill")
    for where, stage in (("step", 0), ("step", 2), ("layer", 0), ("layer", 1), ("layer", 2))
    for phase in ("train", "val")
}


@pytest.fixture(scope="module")
def fast_runs(tmp_path_factory) -> dict[str, FaultRun]:
    """Every fast case, three launches at a time: most of a launch is start-up, and waits overlap."""
    def launch(case: str) -> FaultRun:
        launcher, devices, faults, timeout_s = FAST_CASES[case]
        return run_with_faults(tmp_path_factory.mktemp(case), devices, faults, launcher, timeout_s)

    with ThreadPoolExecutor(max_workers=3) as pool:
        runs = dict(zip(FAST_CASES, pool.map(launch, FAST_CASES)))
    for case, run in runs.items():
        print(f"{case}: every process gone {run.seconds_to_exit:.1f} s after the fault")
    return runs


def check_failure_surfaced(run: FaultRun, faults: list[dict]) -> None:
    assert_ended_fast_everywhere(run)
    first = next(f for f in faults if f["kind"] != "stall")
    if first["kind"] == "raise":
        # The user's exception, type and message, is on the terminal (not only a peer's "connection closed").
        expected = f"InjectedFault: injected fault in {first['where']} on stage {first['stage']} at {first['phase']}"
        assert expected in run.stderr, run.stderr[-6000:]
    else:
        killed = f"stage {first['stage']} \\(rank \\d\\)"
        said = [rf"lost {killed}", r"terminated with signal SIGKILL", r"Signal 9 \(SIGKILL\)", r"exitcode\s*:\s*-9"]
        assert any(re.search(pattern, run.stderr) for pattern in said), run.stderr[-6000:]


@pytest.mark.parametrize("case", [case for case in FAST_CASES if "stall" not in case])
def test_failure_ends_every_process_fast_with_its_cause(case, fast_runs):
    check_failure_surfaced(fast_runs[case], FAST_CASES[case][2])


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(SLOW_CASES))
def test_failure_matrix_ends_every_process_fast_with_its_cause(case, tmp_path):
    launcher, devices, faults, _ = SLOW_CASES[case]
    run = run_with_faults(tmp_path, devices, faults, launcher)
    print(f"{case}: every process gone {run.seconds_to_exit:.1f} s after the fault")
    check_failure_surfaced(run, faults)


def test_stalled_stage_is_caught_by_the_timeout_and_named(fast_runs):
    """The error says which stage waited for which, and for what (stage 1 of 3, rank 1, stalled)."""
    run = fast_runs["spawn-middle-layer-stall"]
    assert_ended_fast_everywhere(run)
    waited = (
        rf"stage [02] \(rank [02]\) timed out after {STALL_TIMEOUT_S} s waiting for"
        r" (the activation of micro-batch \d+ from stage 1 \(rank 1\)|stage 1 \(rank 1\) to receive the activations)"
    )
    assert re.search(waited, run.stderr), run.stderr[-6000:]
    assert "PipelineCommunicationError" in run.stderr
