"""Start a script of this repository in a fresh Python, with this tree first on the import path, and wait for it.

Every test that needs processes of its own comes through :func:`run_python`: the worker scripts of ``tests/workers``
(through :func:`launch`, which hands them a spec file), the examples, the benchmark commands, ``python -c`` checks.
The child gets this repository and ``tests/`` on ``PYTHONPATH`` (so it imports this tree's ``lightning_pipe`` and
the test helpers, whichever copy of the package is installed) and none of a rank's distributed variables.

A worker can be run by hand the same way: ``PYTHONPATH=.:tests python tests/workers/NAME_worker.py SPEC.json``.
:func:`launch` starts it as a fork of a Python that has already imported ``lightning_pipe`` (``helpers/prestarted.py``:
the same as a fresh one, without its start-up), unless ``LIGHTNING_PIPE_TESTS_FRESH=1`` or the launch asks for an
environment of its own; the ranks it starts are fresh processes either way.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helpers.prestarted import Prestarted, Refused, processes_with

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
WORKERS = TESTS / "workers"  # NAME_worker.py serves tests/test_NAME.py; a shared one is named after its job
# A rank's variables would make the script think it is a child rank of some other run.
_RANK_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RANK")


@dataclass
class Finished:
    """How a launched script ended: its exit status, its terminal output, and when it (and what it started) was gone."""

    returncode: int
    stdout: str
    stderr: str
    gone: float  # wall-clock time when the script had ended (with ``marker_variable``: every process it started)
    leftovers: list[int] = field(default_factory=list)  # marked processes still alive at the deadline (then killed)


def launch(
    worker: str, spec: dict, cwd: Path, timeout: float = 300, check: bool = True, prestarted: bool = True, **options
) -> Finished:
    """Run ``tests/workers/WORKER`` on ``spec`` (written to ``cwd/spec.json``); see :func:`run_python`. A fork of the
    prestarted Python unless ``prestarted=False`` (a launch whose launching process the test signals)."""
    cwd.mkdir(parents=True, exist_ok=True)
    spec_path = cwd / "spec.json"
    spec_path.write_text(json.dumps(spec))
    return run_python(WORKERS / worker, spec_path, cwd=cwd, timeout=timeout, check=check, prestarted=prestarted, **options)


def run_python(
    *arguments: str | Path,
    cwd: Path,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    check: bool = True,
    torchrun_processes: int | None = None,
    marker_variable: str | None = None,
    prestarted: bool = False,
) -> Finished:
    """``python ARGUMENTS`` in ``cwd`` (under ``torchrun`` with that many processes, if given), until it ends.

    Its output goes to ``cwd/stdout.txt`` and ``cwd/stderr.txt`` (files, not pipes: ranks that outlive the script
    must not keep the reader waiting). ``env`` is added to the clean environment. With ``marker_variable``, every
    process of the run carries that variable with a value of its own (the launchers pass the environment on), and
    the call waits until none is left. ``prestarted``: the script (not ``-c`` or ``-m``) may start as a fork of
    the prestarted Python (see the module's docstring). Whatever still runs at ``timeout`` seconds is killed; ``check`` then raises,
    as it does for a non-zero exit status.

    A launch whose rendezvous port was taken between Lightning choosing it and binding it (other launches run at the
    same time) is started again, once, without the files the failed start wrote: that is the machine's race, not the
    behaviour under test.
    """
    cwd.mkdir(parents=True, exist_ok=True)
    before = set(cwd.rglob("*"))
    finished = _run_once(arguments, cwd, env, timeout, torchrun_processes, marker_variable, prestarted)
    if finished.returncode != 0 and "EADDRINUSE" in finished.stderr:
        for path in set(cwd.rglob("*")) - before:
            if path.is_file() and path.name not in ("stdout.txt", "stderr.txt"):
                path.unlink()
        finished = _run_once(arguments, cwd, env, timeout, torchrun_processes, marker_variable, prestarted)
    if check and finished.returncode != 0:
        raise AssertionError(
            f"{' '.join(map(str, arguments))} failed ({finished.returncode}):\n"
            f"{finished.stdout[-4000:]}\n{finished.stderr[-8000:]}"
        )
    return finished


def started_together(jobs: Mapping[Any, Callable[[], Any]], at_most: int | None = None) -> dict[Any, Future]:
    """Start every job (a launch, or launches one after another) at once, each in a thread of its own (``at_most``
    at a time): most of a launch is its processes' start-up and their waits on each other, so a file's launches
    together take little more than the longest. A test waits for the result it reads; a failed job fails only the
    tests that read it."""
    pool = ThreadPoolExecutor(at_most or max(len(jobs), 1), thread_name_prefix="launch")
    futures = {name: pool.submit(job) for name, job in jobs.items()}
    pool.shutdown(wait=False)  # the jobs go on; their threads end with them
    return futures


def launches_started_with_first_test(
    reading: tuple[str, ...], jobs: Callable[[Any], Mapping[Any, Callable[[], Any]]]
) -> Any:
    """A module fixture (autouse) that starts the file's launches together with its first test: ``jobs(tmp_path_factory)``
    (see :func:`started_together`), or none when no selected test of the file reads one of the fixtures ``reading``
    (a run of its in-process tests alone). Its value maps each job's name to its future."""
    import pytest

    @pytest.fixture(scope="module", autouse=True)
    def launches(request: Any, tmp_path_factory: Any) -> dict[Any, Future]:
        if not selected_tests_use(request, *reading):
            return {}
        return started_together(jobs(tmp_path_factory))

    return launches


def selected_tests_use(request: Any, *fixtures: str) -> bool:
    """Whether a test of ``request``'s module selected for this run reads one of ``fixtures`` (so a fixture that
    starts launches early, with the module's first test, starts none for a run of its in-process tests alone)."""
    return any(item.module is request.module and set(fixtures) & set(item.fixturenames)
               for item in request.session.items)


def python_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment with this repository and ``tests/`` first on ``PYTHONPATH``, no rank variables."""
    path = os.pathsep.join(filter(None, [str(REPO), str(TESTS), os.environ.get("PYTHONPATH")]))
    environment = {key: value for key, value in os.environ.items() if key not in _RANK_VARIABLES}
    return {**environment, "PYTHONPATH": path, **(env or {})}


_prestarted: Prestarted | None = None
_prestarted_lock = threading.Lock()


def _prestarted_server() -> Prestarted | None:
    """This process's prestarted Python, started at the first launch (None if it could not start, or is turned off)."""
    global _prestarted
    if os.environ.get("LIGHTNING_PIPE_TESTS_FRESH") == "1":
        return None
    with _prestarted_lock:
        if _prestarted is None:
            try:
                _prestarted = Prestarted(python_environment(), tempfile.mkdtemp(prefix="prestarted-"))
            except (OSError, RuntimeError):
                _prestarted = False  # fresh Pythons from now on
            else:
                atexit.register(_prestarted.close)
    return _prestarted or None


def _run_once(
    arguments: tuple[str | Path, ...], cwd: Path, env: dict[str, str] | None, timeout: float,
    torchrun_processes: int | None, marker_variable: str | None, prestarted: bool,
) -> Finished:
    marker = uuid.uuid4().hex
    environment = python_environment({**(env or {}), **({marker_variable: marker} if marker_variable else {})})
    command = [sys.executable, *map(str, arguments)]
    if torchrun_processes is not None:
        command[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun_processes}"]
    server = _prestarted_server() if prestarted and torchrun_processes is None else None
    deadline = time.monotonic() + timeout
    with open(cwd / "stdout.txt", "w") as stdout, open(cwd / "stderr.txt", "w") as stderr:
        process = None
        if server is not None:
            with contextlib.suppress(Refused):  # another environment: a fresh Python
                process = server.start(command[1:], str(cwd), environment, stdout.name, stderr.name,
                                       (marker_variable,) if marker_variable else ())
        if process is None:
            server = None
            # A session of its own: what it starts can be killed with it, and the terminal's signals stay with pytest.
            process = subprocess.Popen(command, stdout=stdout, stderr=stderr, env=environment, cwd=cwd,
                                       start_new_session=True)
        try:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=timeout)  # then the processes it started, which may outlive it
            while marker_variable and processes_with(marker_variable, marker) and time.monotonic() < deadline:
                time.sleep(0.1)
            gone = time.time()
            leftovers = processes_with(marker_variable, marker) if marker_variable else []
            for pid in leftovers:
                os.kill(pid, signal.SIGKILL)
        finally:
            if process.poll() is None:  # past the timeout, or interrupted: the script and its session go
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                for pid in server.leftovers(process) if server is not None else ():  # ranks forked by the server
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        returncode = process.wait()
    return Finished(returncode, (cwd / "stdout.txt").read_text(), (cwd / "stderr.txt").read_text(), gone, leftovers)
