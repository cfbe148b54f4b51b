"""How repeated measurements become one number: medians, and medians of per-round ratios.

A ratio of two configurations is taken round by round (the two steps ran seconds apart) and then the median over
rounds: drift in the machine's load between rounds then cancels instead of landing on one side of the ratio.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


def median_ratio(numerators: Sequence[float], denominators: Sequence[float]) -> float:
    """The median over rounds of ``numerators[i] / denominators[i]``."""
    if len(numerators) != len(denominators):
        raise ValueError(f"{len(numerators)} numerators but {len(denominators)} denominators; pair them by round.")
    return statistics.median(n / d for n, d in zip(numerators, denominators))
