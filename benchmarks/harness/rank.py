"""One rank of a benchmark: join the gloo process group, run the requested function, write its answer as JSON.

Every module of ``ranks/`` ends by handing its entry points to :func:`run_rank`; :func:`harness.launch.launch` starts
it once per rank, with ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, as::

    python -m ranks.MODULE FUNCTION SPEC.json OUT_DIR
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def run_rank(*functions: Callable[[dict[str, Any]], Any]) -> None:
    """Run the one of ``functions`` named on the command line on this rank's spec; write its answer to OUT_DIR."""
    name, spec_path, out_dir = sys.argv[1:4]
    function = {function.__name__: function for function in functions}[name]
    # One compute thread per process: on a CPU machine each stage gets one core, as one device.
    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    dist.init_process_group("gloo")
    try:
        answer = function(spec)
        (Path(out_dir) / f"rank{dist.get_rank()}.json").write_text(json.dumps(answer))
    finally:
        dist.destroy_process_group()
