"""Percentiles for latency reports."""
import math
from collections.abc import Sequence


def percentile(values: Sequence[float], p: float) -> float:
    """The *p*-th percentile (0..100) of *values*.

    Uses linear interpolation between the two closest ranks, the same
    definition as numpy.percentile's default ("linear") method.
    """
    if not values:
        raise ValueError("percentile of empty data")
    if not 0 <= p <= 100:
        raise ValueError(f"p must be within 0..100, got {p}")
    data = sorted(values)
    rank = (len(data) - 1) * p / 100
    lower = math.floor(rank)
    upper = lower + 1
    return data[lower] + (data[upper] - data[lower]) * (rank - lower)


def summary(values: Sequence[float]) -> dict[str, float]:
    """min, p50, p90, p99 and max of *values*."""
    return {
        "min": min(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": max(values),
    }
