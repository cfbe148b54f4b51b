"""The start-up summary: which module is pipelined and what each stage holds."""

from __future__ import annotations


def format_stage_summary(
    module_name: str,
    ranges: list[range],
    parameters: list[int],
    ranks: list[int],
    replicated_parameters: int,
    num_micro_batches: int,
    checkpoint: str,
) -> str:
    """A small table, one row per stage, for ``rank_zero_info`` at start-up."""
    rows = [("stage", "rank", "layers", "parameters")]
    for stage, (layer_range, count, rank) in enumerate(zip(ranges, parameters, ranks)):
        rows.append((str(stage), str(rank), f"{layer_range.start}-{layer_range.stop - 1}", f"{count:,}"))
    widths = [max(len(row[col]) for row in rows) for col in range(4)]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    return "\n".join(
        [
            f"GPipe: pipelining '{module_name}' ({sum(len(r) for r in ranges)} layers) over {len(ranges)} stages,"
            f" {num_micro_batches} micro-batches per batch, checkpoint={checkpoint!r}",
            *lines,
            f"replicated on every stage (outside '{module_name}'): {replicated_parameters:,} parameters",
        ]
    )
