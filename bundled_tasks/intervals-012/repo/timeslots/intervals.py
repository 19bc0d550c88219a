"""Busy/free time computations on closed integer intervals (e.g. minutes of a day)."""
from collections.abc import Iterable

Interval = tuple[int, int]


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Union of closed intervals as a sorted list of disjoint intervals.

    Overlapping or touching intervals ((1, 3) and (3, 5)) are combined.
    """
    merged: list[Interval] = []
    for start, end in sorted(intervals):
        if start > end:
            raise ValueError(f"interval starts after it ends: {(start, end)}")
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def covered(intervals: Iterable[Interval]) -> int:
    """Total length covered by the union of *intervals*."""
    return sum(end - start for start, end in merge(intervals))


def free_slots(busy: Iterable[Interval], day_start: int, day_end: int, min_length: int = 1) -> list[Interval]:
    """Gaps of at least *min_length* between busy intervals within [day_start, day_end]."""
    slots: list[Interval] = []
    cursor = day_start
    for start, end in merge(busy):
        if start - cursor >= min_length:
            slots.append((cursor, min(start, day_end)))
        cursor = max(cursor, end)
        if cursor >= day_end:
            break
    if day_end - cursor >= min_length:
        slots.append((cursor, day_end))
    return slots
