"""Stage gates: limits, priority order, cancellation while waiting."""

from __future__ import annotations

import asyncio

from support.waits import async_wait_until

from rolloutd.daemon.pipeline.gates import StageGate

QUEUE_S = 5.0
"""How long tasks just created may take to queue at a gate."""


async def test_limit_and_priority_order() -> None:
    gate = StageGate("eval", 1)
    await gate.acquire()
    order: list[str] = []

    async def waiter(name: str, prio: int) -> None:
        async with gate.slot(prio):
            order.append(name)

    tasks = [asyncio.ensure_future(waiter("low", 0)), asyncio.ensure_future(waiter("high", 5)),
             asyncio.ensure_future(waiter("low2", 0))]
    await async_wait_until(lambda: gate.waiting == 3, QUEUE_S, "three waiters queued")
    assert gate.stats() == {"limit": 1, "in_use": 1, "waiting": 3}
    gate.release()
    await asyncio.gather(*tasks)
    assert order == ["high", "low", "low2"]
    assert gate.stats() == {"limit": 1, "in_use": 0, "waiting": 0}


async def test_cancelled_waiter_does_not_leak_a_slot() -> None:
    gate = StageGate("init", 1)
    await gate.acquire()
    cancelled = asyncio.ensure_future(gate.acquire())
    later = asyncio.ensure_future(gate.acquire())
    await async_wait_until(lambda: gate.waiting == 2, QUEUE_S, "two waiters queued")
    cancelled.cancel()
    await asyncio.sleep(0)
    gate.release()
    await asyncio.wait_for(later, 1)
    gate.release()
    assert gate.in_use == 0
