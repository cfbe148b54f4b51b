"""A Python that has already imported ``lightning_pipe`` (and with it torch and Lightning) and starts worker scripts
as forks of itself: a launch's first process then costs no start-up (about 7 CPU-seconds a process on 2 cores).

:func:`helpers.launch.launch` starts ``tests/workers`` scripts this way; the ranks those start (Lightning's launchers,
torchrun) are fresh processes as always. A fork is the same as a fresh ``python SCRIPT ARGS`` started with the
environment the server was started with: the same path, the same modules found, nothing run but the imports. So a
launch is only served when the environment it asks for equals the server's, apart from the variables that nothing
reads while importing (:data:`IGNORED`); any other launch starts a fresh Python.

Run as a script, this file is the server: it listens on the Unix socket named by its argument, one connection per
launch. A request is one JSON line ``{"argv", "cwd", "env", "stdout", "stderr"}``; the reply is the child's pid on one
line and, once the child has ended, its wait status on another. The server ends when its standard input closes (the
process that started it has gone).
"""

from __future__ import annotations

import builtins
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
import time
import types

IGNORED = ("PYTEST_CURRENT_TEST",)  # set per test by pytest; a launch's marker variable is also ignored


class Prestarted:
    """The server, started at the first request (``sys.executable`` with ``environment``); None if it cannot start."""

    def __init__(self, environment: dict[str, str], directory: str):
        self.environment = environment
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

    def serves(self, environment: dict[str, str], ignored: tuple[str, ...]) -> bool:
        def relevant(env: dict[str, str]) -> dict[str, str]:
            return {key: value for key, value in env.items() if key not in IGNORED + ignored}

        return self.server.poll() is None and relevant(environment) == relevant(self.environment)

    def start(self, argv: list[str], cwd: str, env: dict[str, str], stdout: str, stderr: str) -> Forked:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        connection.connect(self.path)
        request = {"argv": argv, "cwd": cwd, "env": env, "stdout": stdout, "stderr": stderr}
        connection.sendall(json.dumps(request).encode() + b"\n")
        return Forked(connection)

    def close(self) -> None:
        self.server.stdin.close()  # the server ends; its children run on
        self.server.wait()


class Forked:
    """A script the server forked: what ``subprocess.Popen`` offers ``helpers.launch`` (pid, wait, poll)."""

    def __init__(self, connection: socket.socket):
        self.connection = connection
        self.received = b""
        self.pid = int(self._line(None))
        self.returncode: int | None = None

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
        if self.returncode is None:
            status = self._line(timeout)
            # No status: the server went first (it is not left running while pytest runs); the child is lost to us.
            self.returncode = os.waitstatus_to_exitcode(int(status)) if status else -signal.SIGKILL
            self.connection.close()
        return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(timeout=0)
        except subprocess.TimeoutExpired:
            return None


def serve(path: str) -> dict:
    """Fork a child per request until standard input closes; return the request the caller (a child) must run."""
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
            request = b""
            while not request.endswith(b"\n"):
                request += connection.recv(65536)
            pid = os.fork()
            if pid == 0:
                for open_socket in (listener, connection, *children.values()):
                    open_socket.close()
                return json.loads(request)
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
    script, *arguments = request["argv"]
    sys.argv = [script, *arguments]
    sys.path[0] = os.path.dirname(os.path.abspath(script))


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
    for module in ("lightning.pytorch", "lightning_pipe"):  # what every worker imports first
        importlib.import_module(module)
    sys.path[0] = ""  # replaced by the script's directory in each child
    gc.freeze()  # the children's collections (and their last one, at exit) leave the imported objects alone
    become(serve(sys.argv[1]))
    run_as_main(sys.argv[0])  # an exception or exit status ends the child as it would end `python SCRIPT`
