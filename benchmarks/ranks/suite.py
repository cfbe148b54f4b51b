"""Worker: every measured part in one pair of processes, each part's failure kept to that part."""

from __future__ import annotations

import importlib
import traceback
from typing import Any

import torch.distributed as dist


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    answers: dict[str, Any] = {}
    for part in spec["parts"]:
        try:
            answers[part] = importlib.import_module(f"{part}_worker").measure(spec)
        except Exception:  # noqa: BLE001  (reported by the part's own section; the other parts still run)
            answers[part] = {"error": traceback.format_exc()}
            # The other rank may be blocked in this part: the process group cannot be trusted for the next one.
            break
        dist.barrier()
    return answers
