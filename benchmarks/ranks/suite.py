"""One rank of the shared measurement (:mod:`harness.measurements`): every part in one pair of processes, in turn,
each part's failure kept to that part."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from harness.rank import run_rank
from ranks import memory, overhead, speed

# The parts a spec may ask for, by the name the sections read them under.
PARTS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "speed": speed.measure, "memory": memory.measure, "overhead": overhead.measure,
}


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    answers: dict[str, Any] = {}
    for part in spec["parts"]:
        try:
            answers[part] = PARTS[part](spec)
        except Exception:  # noqa: BLE001  (reported by the part's own section; the other parts still run)
            answers[part] = {"error": traceback.format_exc()}
            # The other rank may be blocked in this part: the process group cannot be trusted for the next one.
            break
        dist.barrier()
    return answers


if __name__ == "__main__":
    run_rank(measure)
