"""What a block returns, learned on the stage that holds it, for a block whose code cannot run on the meta device.

A stage answers the model's call of a block it does not run now with a placeholder: the block's output on the meta
device (:mod:`lightning_pipe.execution.placeholders`), of the right structure and shapes. Code that depends on the
values cannot run there: a mixture of experts routes each token by its values (``torch.nonzero`` has no meta
version; Hugging Face's default ``grouped_mm`` experts kernel demands bf16 there). For such a block, only the stage
that holds it runs its code: on a stand-in input of the call's shapes (random values, its own weights, no gradient;
the random state, BatchNorm statistics, the user's hooks and the block's attributes untouched), once per input
signature. That stage sends the output's structure and shapes to the stages that call the block without holding
it, which wait for it there:

* in a step, with one chunk per stage, those are the stages after the holder: each runs the user's step up to its
  own blocks, calling every block before them; the stages before the holder have handed their step off. A stage
  thus only waits on itself or an earlier stage, which never waits on a later one: no wait is circular, and the
  first step needs no ordering of its own;
* outside a step (a callback calling the model), every stage calls every block: all the others.

Every stage tries the meta device first, the same way on the same shapes, so the holder and the stages that wait
agree, without a message, on which blocks and which input signatures need one. A message is sent once per new input
signature of such a block (a new sequence length is one), never per micro-batch.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._pytree import tree_map_only

from lightning_pipe.execution.call_order import PipelineOrderError
from lightning_pipe.execution.p2p import failed_wait
from lightning_pipe.execution.process_groups import PipelineGroups
from lightning_pipe.execution.recomputation import unchanged_running_stats
from lightning_pipe.execution.stage import StageBlocks
from lightning_pipe.partition.hooks import hooks_set_aside
from lightning_pipe.partition.meta_run import attributes_kept, uncompiled
from lightning_pipe.reliability.stall_rule import Wait

_OUTPUT_TAG = 16  # apart from the activation messages' tags (lightning_pipe.execution.p2p)
_MESSAGE_BYTES = 4096  # one message carries a block's output structure; a larger one takes a second for the rest
_LENGTH_BYTES = 8


class OutputMessages:
    """A block's output structure (meta tensors in their containers) sent between the stages of this rank's pipeline
    (``groups``), over its CPU (gloo) group. Sends never block: the stage that holds a block goes on at once."""

    def __init__(self, groups: PipelineGroups) -> None:
        self.groups = groups
        self._sending: list[tuple[dist.Work, Tensor]] = []  # kept until done: gloo reads the buffer while it sends

    def send(self, output: Any, stages: list[int]) -> None:
        payload = pickle.dumps(output)
        head = len(payload).to_bytes(_LENGTH_BYTES, "little") + payload[: _MESSAGE_BYTES - _LENGTH_BYTES]
        first = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
        first[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
        rest = payload[_MESSAGE_BYTES - _LENGTH_BYTES :]
        buffers = (first, torch.frombuffer(bytearray(rest), dtype=torch.uint8)) if rest else (first,)
        self._sending = [(work, buffer) for work, buffer in self._sending if not work.is_completed()]
        for stage in stages:
            for buffer in buffers:
                work = dist.isend(buffer, self.groups.stage_ranks[stage], group=self.groups.pipeline_cpu, tag=_OUTPUT_TAG)
                self._sending.append((work, buffer))

    def receive(self, stage: int, what: str) -> Any:
        """The output structure that ``stage`` sends (``what``: named if the wait fails)."""
        first = torch.empty(_MESSAGE_BYTES, dtype=torch.uint8)
        self._wait(first, stage, what)
        received = first.numpy().tobytes()
        length = int.from_bytes(received[:_LENGTH_BYTES], "little")
        payload = received[_LENGTH_BYTES : _LENGTH_BYTES + length]
        if length > len(payload):
            rest = torch.empty(length - len(payload), dtype=torch.uint8)
            self._wait(rest, stage, what)
            payload += rest.numpy().tobytes()
        return pickle.loads(payload)

    def _wait(self, buffer: Tensor, stage: int, what: str) -> None:
        groups, peer = self.groups, self.groups.stage_ranks[stage]
        try:
            work = dist.irecv(buffer, peer, group=groups.pipeline_cpu, tag=_OUTPUT_TAG)
            groups.watchdog.wait([work], Wait(what, (peer,)), groups.pipeline_cpu)
        except RuntimeError as error:
            waited = f"waiting for {what} from {groups.describe(stage)}"
            raise failed_wait(groups.describe(), waited, groups.describe(stage), groups.timeout, error) from error


class LearnedOutputs:
    """The outputs of ``stage``'s region's blocks that cannot run on the meta device, from the stage holding each.

    ``in_step()`` says whether the model's current call is a step's (see the module's docstring); ``messages``
    reaches the other stages (``None`` in one process: every block is held here).
    """

    def __init__(
        self, stage: StageBlocks, in_step: Callable[[], bool] = lambda: True, messages: OutputMessages | None = None
    ) -> None:
        self.stage = stage
        self.block_stages = stage.block_stages
        self.in_step = in_step
        self.messages = messages
        self.not_on_meta: dict[int, str] = {}  # block -> why its code cannot run on the meta device
        self._said = False

    def cannot_run_on_meta(self, index: int, error: Exception) -> None:
        """Block ``index`` failed on the meta device (for this input signature): its output comes from its stage.
        The first such block is said once, on global rank 0."""
        self.not_on_meta[index] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        if not self._said:
            self._said = True
            block = self.stage.originals[index]
            rank_zero_info(
                f"The pipelined block {self.stage.region.names[index]} ({type(block).__name__}) cannot run on the meta"
                f" device ({self.not_on_meta[index][:200]}): the stage holding each such block computes the shapes of"
                " its output once per input shape and sends them to the stages that call it (see"
                " docs/existing_project.md, mixtures of experts)."
            )

    def receivers(self, index: int) -> list[int]:
        """The stages that call block ``index`` now without holding it: they wait for its output from its holder."""
        holder, num_stages = self.block_stages[index], self.stage.num_stages
        if not self.in_step():
            return [s for s in range(num_stages) if s != holder]
        return list(range(holder + 1, num_stages))

    def output(self, index: int, args: tuple, kwargs: dict, send: bool = True) -> Any:
        """Block ``index``'s output structure for a call with ``args`` and ``kwargs`` (meta tensors in their
        containers): computed here if this stage holds the block (and sent to the stages that wait for it, with
        ``send``), else received from the stage that holds it."""
        holder = self.block_stages[index]
        if self.stage.num_chunks != self.stage.num_stages:
            raise PipelineOrderError(self._no_virtual_stages(index))
        if holder == self.stage.stage_index:
            output = self._run_here(index, args, kwargs)
            receivers = self.receivers(index) if send else []
            if receivers and self.messages is not None:
                self.messages.send(output, receivers)
            return output
        if self.messages is None:
            raise PipelineOrderError(f"{self.stage.region.names[index]} is held by stage {holder}, which this process cannot reach")
        return self.messages.receive(holder, f"the output shapes of {self.stage.region.names[index]}")

    def _run_here(self, index: int, args: tuple, kwargs: dict) -> Any:
        """The block on a stand-in input of the call's shapes, its output as meta tensors; nothing it touches kept."""
        block = self.stage.originals[index]
        device = next((t.device for t in block.parameters()), torch.device("cpu"))
        generator = torch.Generator(device).manual_seed(0)
        stand_in = lambda t: _stand_in(t, device, generator)  # noqa: E731
        args, kwargs = tree_map_only(Tensor, stand_in, (args, kwargs))
        batch_norms = [m for m in block.modules() if isinstance(m, _BatchNorm)]
        devices = [device] if device.type == "cuda" else []
        try:
            with (
                self.stage.running_blocks(), torch.no_grad(), hooks_set_aside(block.modules()), attributes_kept(block),
                unchanged_running_stats(batch_norms), torch.random.fork_rng(devices=devices, device_type=device.type),
                uncompiled(),  # shapes only: no graph compiled for this one run
            ):
                output = block(*args, **kwargs)
        except Exception as error:
            raise RuntimeError(
                f"{self.stage.region.names[index]} ({type(block).__name__}) cannot run on the meta device"
                f" ({self.not_on_meta.get(index, '?')}), nor on a stand-in input of its call's shapes on its own stage,"
                f" which the pipeline runs to learn the shapes of its output: {type(error).__name__}: {error}"
            ) from error
        return tree_map_only(Tensor, lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta"), output)

    def _no_virtual_stages(self, index: int) -> str:
        return (
            f"{self.stage.region.names[index]} ({type(self.stage.originals[index]).__name__}) cannot run on the meta"
            f" device ({self.not_on_meta.get(index, '?')}), and with several chunks per stage (an interleaved or"
            " V-shaped schedule) the stages that call it cannot learn its output's shapes from the stage holding it."
            " Use a schedule with one chunk per stage (schedule='gpipe', '1f1b' or 'zero_bubble'), or make the block"
            " runnable on the meta device (Hugging Face mixtures of experts: experts_implementation='batched_mm')."
        )


def _stand_in(tensor: Tensor, device: torch.device, generator: torch.Generator) -> Tensor:
    """A real tensor where the call has a meta one (a placeholder): random values for floating point, zeros else."""
    if not tensor.is_meta:
        return tensor
    real = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)
    return real.normal_(generator=generator) if real.is_floating_point() else real.zero_()

