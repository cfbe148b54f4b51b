"""A Python that has already imported ``lightning_pipe`` (and with it torch and Lightning) and starts worker scripts
as forks of itself: a launch's first process then costs no start-up (about 7 CPU-seconds a process on 2 cores).

:func:`helpers.launch.launch` starts ``tests/workers`` scripts this way, and so does such a script's default launcher
for its further ranks (Lightning's ``python SCRIPT ARGS`` per rank: :func:`become` points the launcher at the
server, whose socket a served script finds in its environment, :data:`SERVED`). Ranks of the spawn and fork launchers
and of torchrun start as always. A fork is the same as a fresh ``python SCRIPT ARGS`` started with the environment
the server was started with: the same path, the same modules found, nothing run but the imports. So a script is
only served when the environment it asks for equals the server's, apart from the variables that nothing reads while
importing (:data:`IGNORED`, a launch's marker variable, a rank's :data:`RANK_VARIABLES`); any other starts a fresh
Python. One difference stays: a served rank is the server's child, in a session of its own, not the launching
script's child (:meth:`Prestarted.leftovers` finds it).

Run as a script, this file is the server: it listens on the Unix socket named by its argument, one connection per
launch. A request is one JSON line ``{"argv", "cwd", "env", "stdout", "stderr", "ignored"}``; the reply is the child's
pid on one line and, once the child has ended, its wait status on another (or a refusal, where the environment
differs from the server's in more than the ``ignored`` variables). The server ends when its standard input closes (the
process that started it has gone).
"""

from __future__ import annotations

import builtins
import contextlib
import gc
import importlib
import importlib.machinery
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import types
import uuid

# In a served script's environment: the server's socket, the variables the server ignored for it, and an id of the
# launch (which the ranks it starts carry too).
SERVED = "LIGHTNING_PIPE_TESTS_PRESTARTED"
# Variables nothing reads while importing: set per test by pytest, and by Lightning's seed_everything in the tests'
# own process (read when a run seeds). A launch's marker variable is ignored too.
IGNORED = ("PYTEST_CURRENT_TEST", SERVED, "PL_GLOBAL_SEED", "PL_SEED_WORKERS")
# What Lightning's launcher sets for the ranks it starts. Nothing reads them while importing but Lightning's
# `rank_zero_only`, which a served rank sets again (:func:`become`).
RANK_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")


class Prestarted:
    """The server, started at the first request (``sys.executable`` with ``environment``); None if it cannot start."""

    def __init__(self, environment: dict[str, str], directory: str):
        self.path = os.path.join(directory, "prestarted.sock")
        self.server = subprocess.Popen([sys.executable, __file__, self.path], env=environment, stdin=subprocess.PIPE,
                                       stdout=subprocess.DEVNULL, cwd=directory)
        deadline = time.monotonic() + 120
        while not os.path.exists(self.path) and self.server.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if not os.path.exists(self.path):
            self.server.kill()
            self.server.wait()
            raise RuntimeError("the prestarted Python did not start")

    def start(self, argv: list[str], cwd: str, env: dict[str, str], stdout: str, stderr: str,
              ignored: tuple[str, ...] = ()) -> Forked:
        """``python ARGV`` as a fork of the server (:class:`Refused` if the server would not: another environment, or
        the server gone); what it starts the same way is found by :meth:`leftovers`."""
        served = {"socket": self.path, "ignored": list(ignored), "launch": uuid.uuid4().hex}
        return start(self.path, argv, cwd, {**env, SERVED: json.dumps(served)}, stdout, stderr, ignored)

    @staticmethod
    def leftovers(process: Forked) -> list[int]:
        """The live processes of the launch that started ``process`` (the ranks it started as forks of the server are
        in sessions of their own: killing the launch's session does not end them)."""
        return [pid for pid in processes_with(SERVED, process.served) if pid != process.pid]

    def close(self) -> None:
        self.server.stdin.close()  # the server ends; its children run on
        self.server.wait()


class Refused(Exception):
    """The server would not fork a script asking for another environment (it starts as a fresh Python instead)."""


def same_imports(environment: dict[str, str], server: dict[str, str], ignored: tuple[str, ...]) -> bool:
    """Whether a script with ``environment`` imports what the server (with ``server``) imported."""
    def relevant(env: dict[str, str]) -> dict[str, str]:
        return {key: value for key, value in env.items() if key not in IGNORED + tuple(ignored)}

    return relevant(environment) == relevant(server)


def start(path: str, argv: list[str], cwd: str, env: dict[str, str], stdout: str, stderr: str,
          ignored: tuple[str, ...] | list[str]) -> Forked:
    """Ask the server at ``path`` to fork ``python ARGV``; :class:`Refused` if its environment differs."""
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(path)
    except OSError as error:  # the server has gone
        connection.close()
        raise Refused(str(error)) from None
    request = {"argv": argv, "cwd": cwd, "env": env, "stdout": stdout, "stderr": stderr, "ignored": list(ignored)}
    connection.sendall(json.dumps(request).encode() + b"\n")
    return Forked(connection, env.get(SERVED, ""), argv)


def processes_with(variable: str, value: str) -> list[int]:
    """The live processes whose environment has ``variable=value`` (zombies have an empty environment)."""
    needle = f"{variable}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as environ:
                    if needle in environ.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:  # gone meanwhile, or not ours
                continue
    return found


class Forked:
    """A script the server forked: what ``subprocess.Popen`` offers ``helpers.launch`` and Lightning's launcher (pid,
    wait, poll, send_signal, kill, terminate)."""

    def __init__(self, connection: socket.socket, served: str, argv: list[str]):
        self.connection = connection
        self.served, self.args = served, argv
        self.received = b""
        self.returncode: int | None = None
        self._reading = threading.Lock()
        answer = self._line(None)
        if not answer.isdigit():
            connection.close()
            raise Refused(answer.decode())
        self.pid = int(answer)

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def _line(self, timeout: float | None) -> bytes:
        """The next line from the server (b"" if it closed the connection); TimeoutExpired after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.received:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.connection], [], [], left)[0]:
                raise subprocess.TimeoutExpired(f"pid {getattr(self, 'pid', '?')}", timeout)
            chunk = self.connection.recv(4096)
            if not chunk:
                return b""
            self.received += chunk
        line, self.received = self.received.split(b"\n", 1)
        return line

    def wait(self, timeout: float | None = None) -> int:
        # Several threads may ask (Lightning's child-process observer, the launcher's own): one reads at a time.
        if not self._reading.acquire(timeout=-1 if timeout is None else timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
        try:
            if self.returncode is None:
                status = self._line(timeout)
                # No status: the server went first (it is not left running while pytest runs); the child is lost.
                self.returncode = os.waitstatus_to_exitcode(int(status)) if status else -signal.SIGKILL
                self.connection.close()
            return self.returncode
        finally:
            self._reading.release()

    def poll(self) -> int | None:
        try:
            return self.wait(timeout=0)
        except subprocess.TimeoutExpired:
            return None


def serve(path: str, started_with: dict[str, str], set_by_imports: dict[str, str]) -> dict:
    """Fork a child per request until standard input closes; return the request the caller (a child) must run.
    A request is served if its environment is the one the server started with, but for variables nothing reads while
    importing and those the imports themselves set (a served child gets them as its imports would have set them)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the client waits for the path: ready once it exists
    children: dict[int, socket.socket] = {}
    while True:
        readable, _, _ = select.select([listener, sys.stdin], [], [], 0.05)
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1):
            sys.exit(0)
        if listener in readable:
            connection, _ = listener.accept()
            request = _request_line(connection)
            if request is None:  # the client closed before its request was whole: nothing to serve
                connection.close()
                continue
            asked = json.loads(request)
            ignored = (*asked.get("ignored", ()), *set_by_imports)
            if not same_imports(asked["env"], started_with, ignored):
                differing = sorted(key for key in {*asked["env"], *started_with} - {*IGNORED, *ignored}
                                   if asked["env"].get(key) != started_with.get(key))
                connection.sendall(f"refused: another environment ({', '.join(differing)})\n".encode())
                connection.close()
                continue
            asked["set_by_imports"] = set_by_imports
            pid = os.fork()
            if pid == 0:
                for open_socket in (listener, connection, *children.values()):
                    open_socket.close()
                return asked
            connection.sendall(f"{pid}\n".encode())
            children[pid] = connection
        for pid in list(children):
            ended, status = os.waitpid(pid, os.WNOHANG)
            if ended:
                connection = children.pop(pid)
                try:
                    connection.sendall(f"{status}\n".encode())
                except OSError:  # the client gave up on it
                    pass
                connection.close()


def _request_line(connection: socket.socket) -> bytes | None:
    """A client's request, one line; None if the client closed the connection before the line was whole."""
    request = b""
    while not request.endswith(b"\n"):
        received = connection.recv(65536)
        if not received:
            return None
        request += received
    return request


def become(request: dict) -> None:
    """Turn this forked child into ``python ARGV`` in its own session, as ``subprocess.Popen`` would start it."""
    os.setsid()
    os.chdir(request["cwd"])
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        target = os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(target, fd)
        os.close(target)
    os.environ.clear()
    os.environ.update(request["env"])
    for key, value in request["set_by_imports"].items():  # as the imports of a fresh Python would set them
        os.environ.setdefault(key, value)
    script, *arguments = request["argv"]
    sys.argv = [script, *arguments]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    from lightning.fabric.utilities.rank_zero import _get_rank, rank_zero_only

    rank_zero_only.rank = _get_rank() or 0  # what importing Lightning in this environment would have set
    if SERVED in os.environ:
        _start_ranks_as_forks(json.loads(os.environ[SERVED]))


def _start_ranks_as_forks(served: dict) -> None:
    """Lightning's default launcher starts each further rank as ``python SCRIPT ARGS`` with the rank's variables:
    here, as a fork of the server (a fresh Python where the server cannot serve it: another environment, or an
    output that is no file)."""
    import lightning.fabric.strategies.launchers.subprocess_script as fabric_launcher
    import lightning.pytorch.strategies.launchers.subprocess_script as trainer_launcher

    class ForkingSubprocess:
        """The ``subprocess`` module as Lightning's launcher module sees it, with ``Popen`` asking the server first."""

        def __getattr__(self, name: str):
            return getattr(subprocess, name)

        @staticmethod
        def Popen(command: list[str], env: dict[str, str] | None = None, cwd: str | None = None, **options):  # noqa: N802
            outputs = [os.readlink(f"/proc/self/fd/{fd}") for fd in (1, 2)]
            if (not options and len(command) >= 2 and command[0] == sys.executable and command[1].endswith(".py")
                    and all(os.path.isfile(output) for output in outputs)):
                with contextlib.suppress(OSError, Refused):
                    return start(served["socket"], command[1:], cwd or os.getcwd(),
                                 dict(os.environ) if env is None else env, *outputs,
                                 (*served["ignored"], *RANK_VARIABLES))
            return subprocess.Popen(command, env=env, cwd=cwd, **options)

    for module in (fabric_launcher, trainer_launcher):
        module.subprocess = ForkingSubprocess()


def run_as_main(path: str) -> None:
    """Run the script at ``path`` as ``python PATH`` does: in a new ``__main__`` module."""
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=path, __builtins__=builtins, __spec__=None, __cached__=None,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", path))
    sys.modules["__main__"] = main
    with open(path, "rb") as source:
        code = compile(source.read(), path, "exec")
    exec(code, main.__dict__)


if __name__ == "__main__":
    started_with = dict(os.environ)
    for module in ("lightning.pytorch", "lightning_pipe"):  # what every worker imports first
        importlib.import_module(module)
    set_by_imports = {key: value for key, value in os.environ.items() if started_with.get(key) != value}
    sys.path[0] = ""  # replaced by the script's directory in each child
    gc.freeze()  # the children's collections (and their last one, at exit) leave the imported objects alone
    become(serve(sys.argv[1], started_with, set_by_imports))
    run_as_main(sys.argv[0])  # an exception or exit status ends the child as it would end `python SCRIPT`
