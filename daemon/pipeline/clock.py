"""Stage time bookkeeping: only time spent inside stages counts against a rollout's time-out."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from rolloutd.native_io.errors import OperationTimeout


class StageClock:
    def __init__(self, total_limit_s: float) -> None:
        self.total_limit_s = total_limit_s
        self.stage_s: dict[str, float] = {}
        self.queued_s = 0.0
        self.events: list[tuple[str, str, float]] = []
        """(stage, "enter"|"exit", monotonic time): tests check overlap and ordering with these."""
        self._created = time.monotonic()
        self._stage_start: float | None = None

    @property
    def counted_s(self) -> float:
        running = time.monotonic() - self._stage_start if self._stage_start is not None else 0.0
        return sum(self.stage_s.values()) + running

    def remaining_s(self, stage_limit_s: float) -> float:
        """The time this stage may take: its own limit, capped by what is left of the total."""
        left = self.total_limit_s - self.counted_s
        if left <= 0:
            raise OperationTimeout(f"rollout used its {self.total_limit_s} s of stage time (timeout_s)")
        return min(stage_limit_s, left)

    @contextmanager
    def waiting(self) -> Iterator[None]:
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.queued_s += time.monotonic() - t0

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        t0 = self._stage_start = time.monotonic()
        self.events.append((name, "enter", t0))
        try:
            yield
        finally:
            t1 = time.monotonic()
            self.events.append((name, "exit", t1))
            self.stage_s[name] = self.stage_s.get(name, 0.0) + t1 - t0
            self._stage_start = None
