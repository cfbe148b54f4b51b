"""One rank of the comparison of two trees (``benchmarks/compare_trees.py``): ``Trainer(strategy="gpipe")`` steps on
the Lightning-overhead model, through lightning_pipe's public API only, so that one script measures any commit.

Each rank reports the wall-clock interval between consecutive step ends and the CPU time its process spent in it
(every thread's), the first interval dropped.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.utils.data import DataLoader

from harness.rank import run_rank
from harness.stack import RepeatedBatch, StackModule, make_batch
from harness.timing import StepEnds, measuring_trainer, step_intervals
from harness.workload import Workload
from lightning_pipe import GPipeStrategy


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    work = Workload.from_spec(spec)
    loader = DataLoader(RepeatedBatch(make_batch(work), spec["steps"]), batch_size=None)
    clock = StepEnds()
    strategy = GPipeStrategy(num_micro_batches=work.reference_micro_batches, checkpoint="never")
    trainer = measuring_trainer(strategy, spec["steps"], clock)
    dist.barrier()
    trainer.fit(StackModule(work), loader)
    return {"wall_s": step_intervals(clock.times), "cpu_s": step_intervals(clock.cpu_times)}


if __name__ == "__main__":
    run_rank(measure)
