"""One rank of the speed sections (pipeline, peer): lightning_pipe's engine and the peer, measured in one launch.

Every configuration takes one step per round, in turn, so that drift on a shared machine hits them all alike; the
first ``warmup`` rounds are discarded; the sections summarise the rest (see :mod:`harness.summarize`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.nn.functional as F

from harness.rank import run_rank
from harness.stack import make_batch, make_stack
from harness.timing import in_turns, timed, timed_on
from harness.workload import Workload
from ranks.engine_step import EngineStep
from ranks.peer_step import PeerStep


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Step times (seconds) per configuration, one per measured round, identical on every rank (each step's time is
    its slowest rank's)."""
    work = Workload.from_spec(spec)
    world = dist.group.WORLD
    x, target = make_batch(work)
    whole = make_stack(work)

    def one_process(size: int) -> Callable[[], None]:
        return lambda: F.mse_loss(whole(x[:size]), target[:size]).backward()

    ours = {m: EngineStep(make_stack(work), m, "never") for m in work.micro_batches}
    theirs = {m: PeerStep(make_stack(work), m, world) for m in work.micro_batches}
    # How to time one step of each configuration, by name.
    timers: dict[str, Callable[[], float]] = {"one_process": lambda: timed_on(0, one_process(work.batch))}
    for m in work.micro_batches:
        micro_batch = -(-work.batch // m)  # the largest micro-batch, as the split makes it
        timers[f"micro_batch/{m}"] = lambda size=micro_batch: timed_on(0, one_process(size))
        # The same work on every rank at once: how much running side by side slows each process down here.
        timers[f"micro_batch_side_by_side/{m}"] = lambda size=micro_batch: timed(one_process(size), world)
        timers[f"ours/{m}"] = lambda step=ours[m].step: timed(lambda: step(x, target), world)
        timers[f"peer/{m}"] = lambda step=theirs[m].step: timed(lambda: step(x, target), world)
    return in_turns(timers, work.warmup, work.rounds)


if __name__ == "__main__":
    run_rank(measure)
