"""The stage summary: what each stage holds, where it runs, what it costs, and how even the split is.

Printed once at start-up (like Lightning's ``ModelSummary``) and returned by ``GPipeStrategy.stage_summary()``::

    GPipe: pipelining 'net.model' (8 blocks) over 2 stages, balance='time', 4 micro-batches per batch, checkpoint=...
    Stage | Rank | Device | Blocks | Types            | Params | Time/mb  | Memory | Busy/step
    ------------------------------------------------------------------------------------------
    0     | 1    | cpu    | 0-3    | 2 Linear, 2 Tanh | 480    | 0.373 ms | 2.8 KB | -
    1     | 0    | cpu    | 4-7    | 2 Linear, 2 Tanh | 544    | 0.438 ms | 3.1 KB | -

``Time/mb`` and ``Memory`` are profiled on one micro-batch when ``balance`` is ``"time"`` or ``"memory"`` (memory is
otherwise the parameters' bytes); ``Busy/step`` (forwards plus backwards) is measured in the last training step
that was logged or traced (see ``GPipeStrategy(log_bubble_fraction=..., trace_steps=...)``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count

from lightning_pipe.partition.balance import PartitionPlan, imbalance, recompute_fraction
from lightning_pipe.partition.region import MAX_OUTSIDE_SHARE




@dataclass(frozen=True)
class StageRow:
    """One model chunk of the pipeline (of replica 0): with one chunk per stage, one stage."""

    stage: int
    chunk: int
    rank: int
    device: str
    blocks: range
    block_types: str
    parameters: int
    time_seconds: float | None  # profiled forward + backward (+ re-computation) of one micro-batch
    memory_bytes: int  # parameters, plus activations when profiled
    memory_profiled: bool
    busy_seconds: float | None  # measured forwards + backwards in the last logged or traced training step


@dataclass(frozen=True)
class StageSummary:
    """The summary table's data; ``str()`` renders it."""

    module_name: str
    balance: str
    num_micro_batches: int
    recompute: str  # the re-computation mode (the public option `checkpoint`)
    rows: list[StageRow]  # one per model chunk, in model order
    replicated_parameters: int
    imbalance: float  # slowest stage over the mean stage
    imbalance_basis: str  # what was compared: measured busy time, profiled time, memory or parameters
    # Parameter bytes of other stages' blocks that the rank with the smallest stage holds because the model was built
    # whole on every rank; building it in configure_model() would save them (see docs/memory.md). 0 when it was.
    deferred_saving_bytes: int = 0
    # The modules (or loose parameters) outside the pipelined region: their parameter counts, which stages hold them.
    outside: tuple[tuple[str, int, str], ...] = ()
    schedule: str = "gpipe"
    ideal_bubble: float | None = None  # the schedule's idle share of a step with equal chunks
    # With data_parallel="shard" or "full_shard": the mode, the replicas each stage is sharded over, and each chunk's
    # parameters held by the rank holding the most of them (each parameter split along its first dimension).
    data_parallel: str = "replicate"
    num_replicas: int = 1
    held_per_rank: tuple[int, ...] | None = None
    # With tensor_parallel_size=T > 1: each stage's blocks split over its T ranks; held_per_rank counts one rank's
    # slice of the split layers.
    tensor_parallel: int = 1

    @property
    def num_stages(self) -> int:
        return len({row.stage for row in self.rows})

    @property
    def outside_share(self) -> float:
        """The share of the model's parameters that every stage holds and runs whole."""
        pipelined = sum(row.parameters for row in self.rows)
        total = pipelined + self.replicated_parameters
        return self.replicated_parameters / total if total else 0.0

    def __str__(self) -> str:
        chunked = len(self.rows) != self.num_stages
        columns: list[tuple[str, list[str]]] = [
            ("Stage", [str(row.stage) for row in self.rows]),
            *([("Chunk", [str(row.chunk) for row in self.rows])] if chunked else []),
            ("Rank", [str(row.rank) for row in self.rows]),
            ("Device", [row.device for row in self.rows]),
            ("Blocks", [f"{row.blocks.start}-{row.blocks.stop - 1}" for row in self.rows]),
            ("Types", [row.block_types for row in self.rows]),
            ("Params", [get_human_readable_count(row.parameters) for row in self.rows]),
            *([("T", [str(self.tensor_parallel)] * len(self.rows))] if self.tensor_parallel > 1 else []),
            *([("Params/rank", [get_human_readable_count(n) for n in self.held_per_rank])]
              if self.held_per_rank is not None else []),
            ("Time/mb", [_milliseconds(row.time_seconds) for row in self.rows]),
            ("Memory", [_bytes(row.memory_bytes) + ("" if row.memory_profiled else " (params)") for row in self.rows]),
            ("Busy/step", [_milliseconds(row.busy_seconds) for row in self.rows]),
        ]
        widths = [max(len(name), *(len(cell) for cell in cells)) for name, cells in columns]
        header = " | ".join(name.ljust(width) for (name, _), width in zip(columns, widths))
        num_blocks = sum(len(row.blocks) for row in self.rows)
        chunks = f" in {len(self.rows)} chunks" if chunked else ""
        bubble = f" (ideal bubble {self.ideal_bubble:.2f})" if self.ideal_bubble is not None else ""
        lines = [
            f"GPipe: pipelining '{self.module_name}' ({num_blocks} blocks) over {self.num_stages} stages{chunks},"
            f" schedule={self.schedule!r}{bubble}, balance={self.balance!r}, {self.num_micro_batches} micro-batches"
            f" per batch, checkpoint={self.recompute!r}",
            header,
            "-" * len(header),
        ]
        for i in range(len(self.rows)):
            lines.append(" | ".join(cells[i].ljust(width) for (_, cells), width in zip(columns, widths)))
        lines.append("-" * len(header))
        lines += [
            f"{get_human_readable_count(sum(r.parameters for r in self.rows)).strip()} pipelined params;"
            f" {get_human_readable_count(self.replicated_parameters).strip()} replicated on every stage",
            f"Imbalance (slowest stage / mean): {self.imbalance:.2f} by {self.imbalance_basis}",
        ]
        if self.tensor_parallel > 1:
            lines.append(
                f"tensor_parallel_size={self.tensor_parallel}: each stage's blocks split over its T ranks (DTensor);"
                " Params/rank holds 1/T of the layers the plan splits, the norms, a row-wise layer's bias and the"
                " modules outside the blocks whole (a plan given as a function counts whole: unknown before it runs)"
            )
        if self.held_per_rank is not None and self.data_parallel != "replicate":
            lines.append(
                f"data_parallel={self.data_parallel!r}: each stage sharded over its {self.num_replicas} replicas"
                " (FSDP2); Params/rank is the largest rank's shard, and each rank's gradients and optimizer state"
                " follow it. A module outside the blocks that one stage holds is sharded alike; tied parameters and"
                " those every stage holds stay whole"
                + ("; the stage's whole weights and gradients are held during a step" if self.data_parallel == "shard"
                   else "")
            )
        if self.outside:
            lines += _outside_table(self.outside, self.outside_share)
        if self.deferred_saving_bytes:
            lines.append(
                f"Every rank built all of '{self.module_name}': building it in configure_model() would save up to"
                f" {_bytes(self.deferred_saving_bytes)} of parameters per rank (docs/memory.md)"
            )
        return "\n".join(line.rstrip() for line in lines)


def _outside_table(outside: Sequence[tuple[str, int, str]], share: float) -> list[str]:
    """Where each module outside the blocks lives; a tied one shows its parameters where they first appear."""
    columns = [
        ("Outside the blocks", [name for name, _, _ in outside]),
        ("Params", [get_human_readable_count(n).strip() if n else "tied" for _, n, _ in outside]),
        ("Held by", [where for _, _, where in outside]),
    ]
    widths = [max(len(name), *(len(cell) for cell in cells)) for name, cells in columns]
    lines = [" | ".join(name.ljust(width) for (name, _), width in zip(columns, widths))]
    for i in range(len(outside)):
        lines.append(" | ".join(cells[i].ljust(width) for (_, cells), width in zip(columns, widths)))
    lines.append(f"Held by every stage: {share:.0%} of the parameters")
    return lines


def build_stage_summary(
    plan: PartitionPlan,
    module_name: str,
    ranks: Sequence[int],
    devices: Sequence[str],
    replicated_parameters: int,
    num_micro_batches: int,
    recompute: str,
    busy_seconds: Sequence[float] | None = None,
    built_whole: bool = False,
    outside: Sequence[tuple[str, int, str]] = (),
    owners: Sequence[int] | None = None,
    schedule: str = "gpipe",
    ideal_bubble: float | None = None,
    data_parallel: str = "replicate",
    num_replicas: int = 1,
    held_per_rank: Sequence[int] | None = None,
    tensor_parallel: int = 1,
) -> StageSummary:
    """The summary of ``plan``, whose ranges are the model's chunks, held by the stages ``owners`` (by default chunk
    ``s`` on stage ``s``); ``ranks[s]`` and ``devices[s]`` say where stage ``s`` runs; ``recompute`` is the
    re-computation mode, whose repeated forwards count in the profiled time. ``built_whole``: every rank built the
    whole pipelined module (no deferred construction). ``outside``: the modules outside the pipelined region that hold
    parameters, with their counts and which stages hold them. ``held_per_rank``: with a stage sharded over its
    ``num_replicas`` (``data_parallel``) or its blocks split over ``tensor_parallel`` ranks, each chunk's parameters
    the rank holding the largest part holds."""
    repeated = recompute_fraction(recompute, num_micro_batches)
    owners = list(owners) if owners is not None else list(range(len(plan.ranges)))
    rows = []
    for chunk, block_range in enumerate(plan.ranges):
        stage = owners[chunk]
        blocks = [plan.blocks[i] for i in block_range]
        profiles = [plan.profiles[i] for i in block_range] if plan.profiles is not None else None
        time_seconds = (
            sum(p.forward_seconds * (1 + repeated) + p.backward_seconds for p in profiles)
            if profiles is not None
            else None
        )
        if profiles is not None:
            memory = sum(p.memory_bytes for p in profiles)
        else:
            memory = sum(block.parameter_bytes for block in blocks)
        rows.append(
            StageRow(
                stage,
                chunk,
                ranks[stage],
                devices[stage],
                block_range,
                _block_types([block.type_name for block in blocks]),
                sum(block.parameters for block in blocks),
                time_seconds,
                memory,
                profiles is not None,
                busy_seconds[stage] if busy_seconds is not None and stage not in owners[:chunk] else None,
            )
        )
    num_stages = max(owners) + 1

    def per_stage(value: Callable[[StageRow], float]) -> list[float]:
        return [sum(value(row) for row in rows if row.stage == stage) for stage in range(num_stages)]

    if busy_seconds is not None:
        totals, basis = list(busy_seconds), "measured busy time in the last step"
    elif plan.profiles is not None and plan.method == "memory":
        totals, basis = per_stage(lambda row: float(row.memory_bytes)), "profiled memory"
    elif plan.profiles is not None:
        totals, basis = per_stage(lambda row: row.time_seconds or 0.0), "profiled time"
    elif plan.method == "memory":  # estimated on the meta device: the bytes the split balanced, per stage
        totals = [sum(plan.costs[i] for chunk, block_range in enumerate(plan.ranges) if owners[chunk] == stage
                      for i in block_range) for stage in range(num_stages)]
        basis = "estimated memory (parameters, gradients, optimizer state, activations)"
    else:
        totals, basis = per_stage(lambda row: float(row.parameters)), "parameters"
    chunk_bytes = [sum(plan.blocks[i].parameter_bytes for i in block_range) for block_range in plan.ranges]
    stage_bytes = [sum(b for b, owner in zip(chunk_bytes, owners) if owner == stage) for stage in range(num_stages)]
    saving = sum(stage_bytes) - min(stage_bytes) if built_whole else 0
    return StageSummary(
        module_name, plan.method, num_micro_batches, recompute, rows, replicated_parameters, imbalance(totals), basis,
        saving, tuple(outside), schedule, ideal_bubble, data_parallel, num_replicas,
        tuple(held_per_rank) if held_per_rank is not None else None, tensor_parallel,
    )


def chunk_parameters_per_rank(
    blocks: Sequence[nn.Module], ranges: Sequence[range], replicas: int = 1,
    rank_shapes: Callable[[int, nn.Module], Mapping[str, Sequence[int]]] | None = None,
) -> list[int]:
    """The parameters of each chunk (``ranges`` of ``blocks``) that the rank holding the largest part holds: a layer
    split with tensor parallelism by its slice (``rank_shapes(index, block)``: what one rank holds of each split
    parameter, by name in the block), sharded over ``replicas`` along the first dimension (FSDP2); a parameter that
    several blocks share (tied: kept whole) counted whole."""
    users: dict[int, int] = {}
    for block in blocks:
        for parameter in block.parameters():
            users[id(parameter)] = users.get(id(parameter), 0) + 1

    def held(index: int) -> int:
        shapes = rank_shapes(index, blocks[index]) if rank_shapes is not None else {}
        return sum(p.numel() if users[id(p)] > 1 else largest_shard(shapes.get(name, p.shape), replicas)
                   for name, p in blocks[index].named_parameters())

    return [sum(held(i) for i in chunk) for chunk in ranges]


def largest_shard(shape: Sequence[int], num_shards: int) -> int:
    """The elements of the largest of ``num_shards`` shards of a tensor of ``shape`` split along its first dimension,
    as FSDP2 splits it (``torch.chunk``: ``ceil(rows / num_shards)`` rows each, the last ones fewer)."""
    if not shape:
        return 1
    rows = -(-shape[0] // num_shards)
    per_row = 1
    for size in shape[1:]:
        per_row *= size
    return rows * per_row


def outside_warning(summary: StageSummary, suggestion: Sequence[str] | None = None) -> str | None:
    """The start-up warning when more than a fifth of the parameters run whole on every stage, else ``None``;
    ``suggestion``: the consecutive sibling modules that would pipeline the most of them
    (:func:`lightning_pipe.partition.region.suggested_chain`)."""
    if summary.outside_share <= MAX_OUTSIDE_SHARE:
        return None
    everywhere = [row for row in summary.outside if row[2] == "every stage"]
    largest = max(everywhere, key=lambda row: row[1])[0] if everywhere else "the rest of the model"
    if suggestion:
        fix = (
            f" Pipeline them with the region: GPipeStrategy(module_name={list(suggestion)!r}) pipelines the most"
            " parameters, if the model's code calls these modules one after another, each on the previous one's"
            " output (or name a larger nn.Sequential or nn.ModuleList)."
        )
    else:
        fix = (
            " Pipeline a region that holds them: GPipeStrategy(module_name=...) naming a larger nn.Sequential or"
            " nn.ModuleList, or a list of consecutive sibling modules."
        )
    return (
        f"{summary.outside_share:.0%} of the model's parameters ({summary.replicated_parameters}) are outside the"
        f" pipelined '{summary.module_name}' and run whole on every stage (more than {MAX_OUTSIDE_SHARE:.0%}; the"
        f" largest is {largest}): every stage holds and computes them, so the pipeline saves less memory and time."
        + fix
    )


def model_checkpoint_note(recompute: str) -> str:
    """The start-up note when the model's code calls its pipelined blocks under ``torch.utils.checkpoint``: the
    pipeline's re-computation (the ``checkpoint`` option, ``recompute``) takes the place of the model's."""
    what = {
        "always": "every micro-batch's forward runs again in backward",
        "except_last": "every micro-batch's forward but the last runs again in backward",
        "never": "nothing runs again, which keeps every activation: pass checkpoint='except_last' to save memory",
    }[recompute]
    return (
        "The model calls its pipelined blocks under torch.utils.checkpoint: the pipeline's own re-computation takes"
        f" its place (checkpoint={recompute!r}: {what}), and the model's checkpoint re-runs no block."
    )


def self_checkpointing_warning(recompute: str) -> str:
    """The start-up warning when the pipelined blocks checkpoint themselves (Hugging Face's
    ``gradient_checkpointing_enable()``) and the pipeline re-computes them too."""
    return (
        f"The pipelined blocks checkpoint themselves (gradient_checkpointing=True, e.g. Hugging Face's"
        f" gradient_checkpointing_enable()), and checkpoint={recompute!r} makes the pipeline re-compute each"
        " micro-batch's blocks once more in backward: a third forward where one device runs two. Pass"
        " GPipeStrategy(checkpoint='never') to leave the re-computation to the blocks."
    )


def stage_devices(ranks: Sequence[int], node_devices: Sequence[torch.device], num_nodes: int) -> list[str]:
    """The ``Device`` column: where each of ``ranks`` runs, with its node when there are several (every node runs
    one rank per device of ``node_devices``)."""
    num_processes = len(node_devices)
    return [
        str(node_devices[rank % num_processes])
        if num_nodes == 1
        else f"node {rank // num_processes} {node_devices[rank % num_processes]}"
        for rank in ranks
    ]


def _block_types(names: Sequence[str], limit: int = 40) -> str:
    """``"3 Linear, 3 Tanh"``: each block type with its count, in order of first appearance."""
    text = ", ".join(f"{count} {name}" for name, count in Counter(names).items())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _milliseconds(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{seconds * 1e3:.3g} ms"


def _bytes(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1024 or unit == "GB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GB"
