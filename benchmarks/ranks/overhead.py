"""One rank of the Lightning overhead section: ``Trainer(strategy="gpipe")`` against a plain loop over the engine.

Both train the same model on the same batches with the same optimizer; the plain loop is what the strategy does per
batch without Lightning (the engine's step, ``optimizer.step()``, ``zero_grad``). They take turns: a plain loop, then
a ``Trainer.fit`` with the stall watchdog on (the default) and one with it off, in alternating order, ``fits`` times
after one unmeasured round: the watchdog's cost is the ratio of the two fits. A step's time is the interval between the ends of
consecutive steps on the last stage (global rank 0), so it covers everything a loop iteration does; the first
interval of each run is dropped; each rank also reports the CPU time its process spent in those intervals (every
thread's: the watchdog's thread included). The answer keeps every interval, by round, for the sections to summarise.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from harness.rank import run_rank
from harness.stack import LEARNING_RATE, RepeatedBatch, StackModule, make_batch, make_stack
from harness.timing import StepEnds, measuring_trainer, step_intervals
from harness.workload import Workload
from lightning_pipe import GPipeStrategy
from ranks.engine_step import EngineStep

def measure(spec: dict[str, Any]) -> dict[str, Any]:
    work = Workload.from_spec(spec)
    m = work.reference_micro_batches
    loader = DataLoader(RepeatedBatch(make_batch(work), work.steps_per_fit), batch_size=None)
    # Per measured round: the step intervals of the plain loop, of the Trainer, of the Trainer without the watchdog.
    plain, lightning, unwatched, lightning_cpu, unwatched_cpu = [], [], [], [], []
    for round_index in range(1 + work.fits):
        engine_times = _plain_loop(work, m, loader)
        watchdog_order = (True, False) if round_index % 2 else (False, True)
        fits = {watchdog: _lightning_fit(work, m, loader, watchdog) for watchdog in watchdog_order}
        if round_index > 0:
            plain.append(step_intervals(engine_times))
            lightning.append(step_intervals(fits[True].times))
            unwatched.append(step_intervals(fits[False].times))
            lightning_cpu.append(step_intervals(fits[True].cpu_times))
            unwatched_cpu.append(step_intervals(fits[False].cpu_times))
    return {"micro_batches": m, "plain_s": plain, "lightning_s": lightning, "lightning_unwatched_s": unwatched,
            "lightning_cpu_s": lightning_cpu, "lightning_unwatched_cpu_s": unwatched_cpu}


def _plain_loop(work: Workload, m: int, loader: DataLoader) -> list[float]:
    step = EngineStep(make_stack(work), m, "never")
    optimizer = torch.optim.SGD(step.stage.parameters(), lr=LEARNING_RATE)
    ends = []
    dist.barrier()
    for x, target in loader:
        step.step(x, target)
        optimizer.step()
        optimizer.zero_grad()
        ends.append(time.perf_counter())
    return ends


def _lightning_fit(work: Workload, m: int, loader: DataLoader, stall_watchdog: bool = True) -> StepEnds:
    clock = StepEnds()
    strategy = GPipeStrategy(num_micro_batches=m, checkpoint="never", stall_watchdog=stall_watchdog)
    trainer = measuring_trainer(strategy, work.steps_per_fit, clock)
    dist.barrier()
    trainer.fit(StackModule(work), loader)
    return clock


if __name__ == "__main__":
    run_rank(measure)
