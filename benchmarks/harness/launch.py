"""Starting a benchmark's processes: one fresh Python per rank, joined by torch.distributed over gloo.

Each rank runs the module of ``ranks/`` that holds the function (``python -m ranks.MODULE``), which calls it on
the spec through :func:`harness.rank.run_rank` and writes what it returns as JSON; :func:`launch` gathers those
answers. Fresh processes (rather than forking this one) keep every measurement
free of the launching process's threads and memory, and let a worker start Lightning's ``Trainer`` as a user's
script would.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parents[1]
REPO = BENCHMARKS.parent
# Every tensor of 64 KiB or more in a mapping of its own, returned to the system when freed: resident memory then
# follows the live tensors. With glibc's default, the threshold rises to 32 MiB as large blocks are freed, and the heap
# keeps freed blocks (a step's old gradients) that the next allocations do not all reuse.
SMALL_HEAP = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def launch(
    function: Callable[[dict[str, Any]], Any],
    world_size: int,
    spec: dict[str, Any],
    timeout: float = 600,
    env: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Run ``function(spec)``, a function of a ``ranks/`` module, on ``world_size`` ranks (``env`` added to their
    environment); the answers, by rank."""
    module, name = function.__module__, function.__name__
    with tempfile.TemporaryDirectory(prefix="lightning_pipe_bench_") as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        env = {**_worker_environment(world_size), **(env or {})}
        processes = []
        for rank in range(world_size):
            rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "NODE_RANK": "0"}
            command = [sys.executable, "-m", module, name, str(spec_path), tmp]
            processes.append(
                subprocess.Popen(command, env=rank_env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            )
        logs = []
        try:
            for process in processes:
                logs.append(process.communicate(timeout=timeout)[0])
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
        failed = [(rank, p.returncode) for rank, p in enumerate(processes) if p.returncode != 0]
        if failed:
            tails = "\n".join(f"--- rank {rank} ---\n{log[-4000:]}" for rank, log in enumerate(logs))
            raise RuntimeError(f"benchmark {module}.{name} failed on ranks {failed}:\n{tails}")
        return [json.loads((Path(tmp) / f"rank{rank}.json").read_text()) for rank in range(world_size)]


def _worker_environment(world_size: int) -> dict[str, str]:
    """The launching environment with one compute thread per process and a fresh rendezvous address."""
    env = {key: value for key, value in os.environ.items() if key not in ("RANK", "LOCAL_RANK", "NODE_RANK")}
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(BENCHMARKS), str(REPO), env.get("PYTHONPATH", "")) if p),
    )
    return env


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
