"""Admission of sandbox starts: how many run at once, how fast one image is started, and how many
may wait.

A burst of starts (a trainer asking for 512 sandboxes at once) all launched together makes every
one of them slow: each ``apptainer instance start`` forks a starter, mounts the image and sets up
namespaces, and hundreds of them on a few cores each take longer than its deadline, so a burst
fails on timeouts or appears to hang (SWE-ReX 261, rLLM 269, SkyRL 9 report both). Here starts
run ``concurrency`` at a time, first come first served, so each takes about what one alone takes
and the burst finishes at the machine's pace; one image is started at most ``image_rate_per_s``
times a second (a token bucket holding ``image_burst``), which keeps one image's mounts from
crowding out the others'; and at most ``max_queued`` starts wait: past that a start is refused at
once with an error that says so, never left to time out in a queue with no end.

A start someone is waiting for (a cold lease: a rollout's init stage, a trainer's ``open_sandbox``)
takes the next free slot before the warm pool's refills: in arrival order it waited for every
refill queued ahead of it (each a whole instance start), while a refill only restocks a pool that
nobody is waiting on yet.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from rolloutd.native_io.errors import ConfigError, SandboxStartError


class StartQueueFull(SandboxStartError):
    """More starts are waiting than the gate's ``max_queued``."""


@dataclass(frozen=True)
class StartGateConfig:
    concurrency: int = 2
    """Starts running at once in this pool."""
    image_rate_per_s: float = 20.0
    """Starts of one image per second, at most (0: no limit)."""
    image_burst: int = 8
    """Starts of one image allowed at once before the rate applies."""
    max_queued: int = 4096
    """Starts that may wait for a slot; one more is refused (StartQueueFull)."""

    def __post_init__(self) -> None:
        for name in ("concurrency", "image_burst", "max_queued"):
            if getattr(self, name) < 1:
                raise ConfigError(f"start gate: {name} must be >= 1, got {getattr(self, name)}")
        if self.image_rate_per_s < 0:
            raise ConfigError(f"start gate: image_rate_per_s must be >= 0, got {self.image_rate_per_s}")


class StartGate:
    def __init__(self, config: StartGateConfig | None = None) -> None:
        self.config = config or StartGateConfig()
        self._free = self.config.concurrency
        self._waiting_foreground: deque[asyncio.Future[None]] = deque()
        """Starts someone waits for, waiting for a slot: served first."""
        self._waiting_refills: deque[asyncio.Future[None]] = deque()
        self._next_start: dict[str, float] = {}
        """Per image: the earliest time its bucket allows the next start (a full bucket is ``now
        - (burst - 1) / rate``, so ``burst`` starts may go at once)."""
        self.waiting = 0
        self.running = 0
        self.max_waiting_seen = 0

    @contextlib.asynccontextmanager
    async def slot(self, image: str, *, background: bool = False) -> AsyncIterator[float]:
        """Hold a start slot for ``image``; yields the seconds spent waiting for it. ``background``:
        a refill nobody waits for, which lets every other start go first."""
        cfg = self.config
        if self.waiting >= cfg.max_queued:
            raise StartQueueFull(
                f"{self.waiting} sandbox starts are already waiting (start gate max_queued={cfg.max_queued}, "
                f"{cfg.concurrency} at a time); retry later or raise max_queued")
        queued_at = time.monotonic()
        self.waiting += 1
        self.max_waiting_seen = max(self.max_waiting_seen, self.waiting)
        try:
            await self._image_turn(image)
            await self._acquire(background)
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            yield time.monotonic() - queued_at
        finally:
            self.running -= 1
            self._release()

    async def _acquire(self, background: bool) -> None:
        if self._free:
            self._free -= 1
            return
        granted = asyncio.get_running_loop().create_future()
        (self._waiting_refills if background else self._waiting_foreground).append(granted)
        try:
            await granted
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self._release()  # handed a slot in the instant it was cancelled: pass it on
            raise

    def _release(self) -> None:
        """Hand the slot to the first start waiting, someone's before a refill's."""
        for queue in (self._waiting_foreground, self._waiting_refills):
            while queue:
                granted = queue.popleft()
                if not granted.done():  # a cancelled waiter's future is done
                    granted.set_result(None)
                    return
        self._free += 1

    async def _image_turn(self, image: str) -> None:
        """Wait until ``image``'s bucket holds a token, and take it (reserved in arrival order)."""
        rate = self.config.image_rate_per_s
        if not rate:
            return
        now = time.monotonic()
        interval = 1.0 / rate
        earliest = max(self._next_start.get(image, float("-inf")), now - (self.config.image_burst - 1) * interval)
        self._next_start[image] = earliest + interval
        if earliest > now:
            await asyncio.sleep(earliest - now)  # the rate itself: a reserved start time, not a poll
