"""One rank of the memory section: what each stage keeps for backward, per checkpoint mode, and what it costs.

What a stage keeps between its forward and its backward is counted in two ways, and their storages joined:

* tensors autograd saves, seen by ``torch.autograd.graph.saved_tensors_hooks`` (re-computation's own hooks hide
  what the layers save inside a checkpointed micro-batch; its inputs are saved where these hooks see them);
* tensors the engine itself holds from Python (received inputs, outputs awaiting their gradients), found by the
  garbage collector among the objects created during the forward.

Parameters are left out, and the last stage's joined output (the user's to keep) too. Re-computation rebuilds one
micro-batch's activations at a time during backward: exactly what an un-checkpointed forward of that micro-batch
saves, measured here by running the stage's layers on one micro-batch under the same hooks.
"""

from __future__ import annotations

import gc
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from harness.rank import run_rank
from harness.stack import make_batch, make_stack
from harness.timing import in_turns, timed
from harness.workload import Workload
from ranks.engine_step import EngineStep

MODES = ("never", "except_last", "always")


class SavedStorages:
    """The storages autograd saves inside a ``with`` block, by address, with their sizes; some left out."""

    def __init__(self, excluded: set[int]) -> None:
        self.excluded = excluded
        self.sizes: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def _pack(self, tensor: Tensor) -> Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.excluded:
            self.sizes[storage.data_ptr()] = storage.nbytes()
        return tensor

    def __enter__(self) -> SavedStorages:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def live_storages() -> dict[int, int]:
    """Storages of every tensor reachable from Python, by address, with their sizes."""
    found: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, Tensor) and obj.device.type != "meta":
            storage = obj.untyped_storage()
            found[storage.data_ptr()] = storage.nbytes()
    return found


def storages_of(tensors: Iterable[Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def measure(spec: dict[str, Any]) -> dict[str, Any]:
    work = Workload.from_spec(spec)
    m = work.reference_micro_batches
    world = dist.group.WORLD
    x, target = make_batch(work)
    steps = {mode: EngineStep(make_stack(work), m, mode) for mode in MODES}
    result: dict[str, Any] = {"modes": MODES, "micro_batches": m, "stage": next(iter(steps.values())).stage.stage_index}
    for mode, step in steps.items():
        step.step(x, target)  # warm-up: gradients allocated, lazy state built
        result[mode] = _kept_for_backward(step, x, target)
    result["inside_bytes"], result["boundary_bytes"] = _one_micro_batch(steps["never"], x, m)
    timers = {mode: (lambda step=step: timed(lambda: step.step(x, target), world)) for mode, step in steps.items()}
    result["step_s"] = in_turns(timers, work.warmup, work.rounds)  # per mode, one step time per measured round
    return result


def _kept_for_backward(step: EngineStep, x: Tensor, target: Tensor) -> int:
    """Bytes this stage keeps from the end of its forward until its backward."""
    parameters = storages_of(step.stage.parameters())
    gc.collect()
    before = live_storages()
    with SavedStorages(parameters) as saved:
        output = step.stage_forward(x)
    gc.collect()
    held = {ptr: size for ptr, size in live_storages().items() if ptr not in before and ptr not in parameters}
    if isinstance(output, Tensor):
        held.pop(output.untyped_storage().data_ptr(), None)
    kept = sum({**held, **saved.sizes}.values())
    step.backward(output, target)
    return kept


def _one_micro_batch(step: EngineStep, x: Tensor, num_micro_batches: int) -> tuple[int, int]:
    """(activations one micro-batch saves inside this stage, bytes of its input at the stage boundary)."""
    rows = -(-x.shape[0] // num_micro_batches)
    stage_input = torch.randn(rows, x.shape[1], requires_grad=0 not in step.stage.chunk_ranges)
    parameters = storages_of(step.stage.parameters())
    with SavedStorages(parameters | storages_of([stage_input])) as saved, step.stage.running_blocks():
        value = stage_input
        for block in step.stage.blocks:  # the stack's blocks take and return one tensor
            value = block(value)
    return sum(saved.sizes.values()), stage_input.untyped_storage().nbytes()


if __name__ == "__main__":
    run_rank(measure)
