"""One rank of the step agreement section: what comparing the stages' steps costs (see
:mod:`lightning_pipe.execution.step_agreement`).

Two measurements on the same small 2-stage model, whose short steps show a cost per step most:

* fits with the check on and off taking turns (``rounds`` pairs after one unmeasured pair, in alternating order).
  Off, the runtime computes no step signature: no message carries one and none is compared. Each fit's step is the
  median interval between the ends of consecutive steps on this rank, wall-clock and CPU time (every thread's);
* the check's own work, both ends' of one step on this rank (an upper bound: a stage sends or receives, or both in
  the middle of a pipeline), timed alone many times on the fit's batch: the signature of the step (what Lightning's
  loop says of it included), the header of a step's first message with it against one without, read back, and the
  comparison.
"""

from __future__ import annotations

import time
import timeit
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import lightning_pipe.execution.runtime as runtime
from harness.rank import run_rank
from harness.stack import RepeatedBatch, StackModule, make_batch
from harness.timing import StepEnds, measuring_trainer, step_intervals
from harness.summarize import median
from harness.workload import Workload
from lightning_pipe import GPipeStrategy
from lightning_pipe.execution.p2p import ACTIVATION, Header, TensorMeta
from lightning_pipe.execution.step_agreement import check_same_step, step_signature_of

CHECKED = runtime.step_signature_of


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    work = Workload.from_spec(spec)
    m, rounds = spec["micro_batches"], spec["rounds"]
    batch = make_batch(work)
    loader = DataLoader(RepeatedBatch(batch, work.steps_per_fit), batch_size=None)
    on, off, on_cpu, off_cpu = [], [], [], []
    module = None
    for round_index in range(1 + rounds):
        fits = {}
        for checked in (True, False) if round_index % 2 else (False, True):
            fits[checked], module = _fit(work, m, loader, checked)
        if round_index > 0:
            on.append(median(step_intervals(fits[True].times)))
            off.append(median(step_intervals(fits[False].times)))
            on_cpu.append(median(step_intervals(fits[True].cpu_times)))
            off_cpu.append(median(step_intervals(fits[False].cpu_times)))
    return {"micro_batches": m, "on_s": on, "off_s": off, "on_cpu_s": on_cpu, "off_cpu_s": off_cpu,
            "check_s": _check_alone(module, batch, work.width, m)}


def _fit(work: Workload, m: int, loader: DataLoader, checked: bool) -> tuple[StepEnds, StackModule]:
    runtime.step_signature_of = CHECKED if checked else (lambda *args, **kwargs: None)
    try:
        clock = StepEnds()
        trainer = measuring_trainer(GPipeStrategy(num_micro_batches=m, checkpoint="never"), work.steps_per_fit, clock)
        module = StackModule(work)
        dist.barrier()
        trainer.fit(module, loader)
        return clock, module
    finally:
        runtime.step_signature_of = CHECKED


def _check_alone(module: Any, batch: Any, width: int, m: int, number: int = 2000) -> float:
    """Seconds of the check's work per step on one rank (the best of five timings of ``number`` steps): the step's
    signature, the header of its first message with it less one without (written and read), and the comparison."""
    signature = step_signature_of(module, "training_step", (batch, 3), {})
    metas = (TensorMeta((batch[0].shape[0] // m, width), torch.float32, True),)
    signed, plain = (Header(ACTIVATION, 0, m, metas, False, 1, (), s) for s in (signature, None))
    encoded_signed, encoded_plain = signed.encode(), plain.encode()

    def with_check() -> None:
        mine = step_signature_of(module, "training_step", (batch, 3), {})
        check_same_step(mine, Header.decode(signed.encode()).step, "here", "there")

    def without() -> None:
        Header.decode(plain.encode())

    def best(function: Any) -> float:
        return min(timeit.repeat(function, number=number, repeat=5)) / number

    assert encoded_signed.shape == encoded_plain.shape  # the message is as long either way
    time.sleep(0.1)
    return best(with_check) - best(without)


if __name__ == "__main__":
    run_rank(measure)
