"""Markdown pieces shared by the benchmark sections: tables and target verdicts."""

from __future__ import annotations

from collections.abc import Sequence

# How a section states a target and whether it holds; the runner lists these lines at the top of the page.
TARGET_LINE = "**Target**"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join(" --- " for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def verdict(target: str, holds: bool, measured: str) -> str:
    """One line stating a target, the measured value and whether the target holds."""
    return f"{TARGET_LINE} {target}: measured {measured}, {'holds' if holds else 'does not hold'}."
