"""One rank of a benchmark: join the gloo process group, run the requested function, write its answer as JSON.

Usage (what :func:`launch.launch` runs, once per rank, with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` set)::

    python benchmarks/worker.py MODULE FUNCTION SPEC.json OUT_DIR
"""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main(module: str, function: str, spec_path: str, out_dir: str) -> None:
    # One compute thread per process: on a CPU machine each stage gets one core, as one device.
    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    dist.init_process_group("gloo")
    try:
        answer = getattr(importlib.import_module(module), function)(spec)
        (Path(out_dir) / f"rank{dist.get_rank()}.json").write_text(json.dumps(answer))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
