"""Markdown pieces shared by the benchmark sections: tables and target verdicts."""

from __future__ import annotations

from collections.abc import Sequence


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def verdict(target: str, holds: bool, measured: str) -> str:
    """One line stating a target, the measured value and whether the target holds."""
    return f"**Target** {target}: measured {measured}, {'holds' if holds else 'does not hold'}."
