"""Stage gates: a bounded number of holders per stage, waiters served by priority then arrival.

Each stage of the pipeline has its own gate, so a request waiting for an eval slot never holds
anything another request needs for its agent turns.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


class StageGate:
    def __init__(self, name: str, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"stage {name}: limit must be >= 1")
        self.name = name
        self.limit = limit
        self.in_use = 0
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    @property
    def waiting(self) -> int:
        return sum(1 for _, _, f in self._waiters if not f.done())

    async def acquire(self, priority: int = 0) -> None:
        if self.in_use < self.limit and not self.waiting:
            self.in_use += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (-priority, next(self._seq), fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release_one()  # the slot was handed to us as we were cancelled: pass it on
            raise

    def release(self) -> None:
        self._release_one()

    def _release_one(self) -> None:
        while self._waiters:
            _, _, fut = heapq.heappop(self._waiters)
            if not fut.done():
                fut.set_result(None)  # the slot moves to the waiter; in_use is unchanged
                return
        self.in_use -= 1

    @asynccontextmanager
    async def slot(self, priority: int = 0) -> AsyncIterator[None]:
        await self.acquire(priority)
        try:
            yield
        finally:
            self.release()

    def stats(self) -> dict[str, int]:
        return {"limit": self.limit, "in_use": self.in_use, "waiting": self.waiting}
