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
import torch
from lightning.pytorch import seed_everything

from helpers.compare import REPO, WORKERS, launch
from helpers.models import ProjectModule
from lightning_pipe import GPipeStrategy

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


def run_marked(
    worker: str, spec: dict, tmp_path: Path, torchrun_processes: int | None = None, deadline_s: float = 300
) -> tuple[int, float, list[int]]:
    """Run ``workers/WORKER`` on ``spec`` (under torchrun with that many processes, if given) until every process
    it started has ended. Returns its exit status, the wall-clock time when none was left, and the processes still
    alive at the deadline (killed then, so that a failing test leaves nothing behind)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    marker = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", MARKER_VARIABLE: marker}
    for variable in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RANK"):
        env.pop(variable, None)
    command = [sys.executable, str(WORKERS / worker), str(spec_path)]
    if torchrun_processes is not None:
        command[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun_processes}"]
    with open(tmp_path / "stderr.txt", "w") as stderr, open(tmp_path / "stdout.txt", "w") as stdout:
        process = subprocess.Popen(command, stdout=stdout, stderr=stderr, env=env, cwd=tmp_path, start_new_session=True)
        started = time.monotonic()
        while (marked_processes(marker) or process.poll() is None) and time.monotonic() - started < deadline_s:
            time.sleep(0.1)
        gone = time.time()
        leftovers = marked_processes(marker)
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
        return process.wait(), gone, leftovers


def run_with_faults(
    tmp_path: Path, devices: int, faults: list[dict], launcher: str = "gpipe", timeout_s: float | None = None
) -> FaultRun:
    """Launch ``fault_runs.py`` under ``launcher`` (``gpipe``, ``gpipe_spawn`` or ``torchrun``) and watch it end."""
    spec = {"devices": devices, "out": str(tmp_path), "faults": faults, "timeout_s": timeout_s,
            "strategy": "gpipe_spawn" if launcher == "gpipe_spawn" else "gpipe"}
    returncode, gone, leftovers = run_marked(
        "fault_runs.py", spec, tmp_path, torchrun_processes=devices if launcher == "torchrun" else None
    )
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


# ---- 3. nothing lost on a crash -------------------------------------------------------------------------------------


def relative_change_error(initial: dict, expected: dict, actual: dict) -> float:
    """|actual - expected| / |expected - initial| over the floating-point tensors of a state dict."""
    keys = [key for key, value in expected.items() if value.is_floating_point()]
    error = sum(float(((actual[key] - expected[key]) ** 2).sum()) for key in keys) ** 0.5
    change = sum(float(((expected[key] - initial[key]) ** 2).sum()) for key in keys) ** 0.5
    assert change > 1e-2, "training barely changed the weights"
    return error / change


def test_run_killed_mid_epoch_resumes_from_last_as_uninterrupted_training(tmp_path):
    """3 epochs on 2 stages, a last checkpoint at each epoch end; the first stage's rank is SIGKILLed at batch 1 of
    epoch 2. Rerun with ckpt_path="last": the final weights are those of the same training without the crash."""
    crash = {"devices": 2, "out": str(tmp_path), "epochs": 3, "mode": "crash",
             "kill": {"epoch": 2, "batch": 1, "stage": 0}}
    returncode, _, leftovers = run_marked("crash_resume_runs.py", crash, tmp_path / "crash")
    assert returncode != 0 and not leftovers, (tmp_path / "crash" / "stderr.txt").read_text()[-4000:]
    last = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)
    assert (last["epoch"], last["global_step"]) == (1, 8), "the last checkpoint is not the end of epoch 1"

    launch("crash_resume_runs.py", {**crash, "mode": "resume"}, tmp_path / "resume")
    seed_everything(0)
    initial = ProjectModule(scheduler="epoch").state_dict()
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
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
