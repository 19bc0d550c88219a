"""The start gate: starts run a few at a time in arrival order, someone's before the warm pool's
refills, one image at a bounded rate, and past the queue's bound a start is refused at once; a
burst of cold leases through a real pool all start, none on a timeout."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from support.waits import async_wait_until

from rolloutd.daemon.sandbox.apptainer import ApptainerBackend
from rolloutd.daemon.sandbox.base import SandboxBackend, SandboxSpec
from rolloutd.daemon.sandbox.pool import WarmPool
from rolloutd.daemon.sandbox.start_gate import StartGate, StartGateConfig, StartQueueFull
from rolloutd.native_io.errors import ConfigError, SandboxStartError

QUEUED_TIMEOUT_S = 10.0
"""How long a test waits for started tasks to reach the gate's queue (a few loop rounds)."""


async def test_starts_run_a_few_at_a_time_in_arrival_order() -> None:
    gate = StartGate(StartGateConfig(concurrency=3, image_rate_per_s=0))
    order: list[int] = []
    peak = 0

    async def start(i: int) -> None:
        nonlocal peak
        async with gate.slot("img"):
            order.append(i)
            peak = max(peak, gate.running)
            await asyncio.sleep(0.01)

    async with asyncio.timeout(10):
        await asyncio.gather(*(start(i) for i in range(12)))
    assert peak == 3 and gate.running == 0 and gate.waiting == 0
    assert order == list(range(12))
    assert gate.max_waiting_seen >= 9


async def test_a_start_someone_waits_for_goes_before_the_refills_queued_ahead_of_it() -> None:
    gate = StartGate(StartGateConfig(concurrency=1, image_rate_per_s=0))
    release = asyncio.Event()
    order: list[str] = []

    async def start(name: str, background: bool) -> None:
        async with gate.slot("img", background=background):
            order.append(name)
            await release.wait()

    async with asyncio.timeout(10):
        first = asyncio.create_task(start("refill-0", True))  # takes the only slot
        refills = [asyncio.create_task(start(f"refill-{i}", True)) for i in range(1, 4)]
        await async_wait_until(lambda: gate.waiting == 3, QUEUED_TIMEOUT_S, "three refills queued")
        cancelled = asyncio.create_task(start("gave-up", False))
        lease = asyncio.create_task(start("lease", False))
        await async_wait_until(lambda: gate.waiting == 5, QUEUED_TIMEOUT_S, "two leases queued behind them")
        cancelled.cancel()  # a waiter that leaves hands nothing on and takes no slot
        release.set()
        await asyncio.gather(first, *refills, lease)
    assert order == ["refill-0", "lease", "refill-1", "refill-2", "refill-3"]
    assert cancelled.cancelled() and gate.running == 0 and gate.waiting == 0


async def test_past_the_queue_bound_a_start_is_refused_at_once() -> None:
    gate = StartGate(StartGateConfig(concurrency=1, image_rate_per_s=0, max_queued=2))
    release = asyncio.Event()
    started: list[int] = []

    async def start(i: int) -> None:
        async with gate.slot("img"):
            started.append(i)
            await release.wait()

    async with asyncio.timeout(10):
        tasks = [asyncio.create_task(start(i)) for i in range(3)]  # one runs, two wait
        await async_wait_until(lambda: gate.waiting == 2, QUEUED_TIMEOUT_S, "two starts queued")
        t0 = time.monotonic()
        with pytest.raises(StartQueueFull, match="2 sandbox starts are already waiting.*max_queued=2") as info:
            async with gate.slot("img"):
                pass
        assert time.monotonic() - t0 < 0.5 and isinstance(info.value, SandboxStartError)
        release.set()
        await asyncio.gather(*tasks)
    assert started == [0, 1, 2]


async def test_one_image_is_started_at_a_bounded_rate_and_others_are_not_held() -> None:
    gate = StartGate(StartGateConfig(concurrency=8, image_rate_per_s=10, image_burst=2))
    times: dict[str, list[float]] = {"a": [], "b": []}

    async def start(image: str) -> None:
        async with gate.slot(image):
            times[image].append(time.monotonic())

    t0 = time.monotonic()
    async with asyncio.timeout(10):
        await asyncio.gather(*(start("a") for _ in range(6)), start("b"))
    # Two at once (the burst), then one every 100 ms: the sixth no earlier than 4 x 100 ms.
    assert times["a"][1] - t0 < 0.08
    assert times["a"][-1] - t0 >= 0.4 - 0.01
    assert times["b"][0] - t0 < 0.08


def test_config_is_checked() -> None:
    with pytest.raises(ConfigError, match="concurrency must be >= 1"):
        StartGateConfig(concurrency=0)
    with pytest.raises(ConfigError, match="image_rate_per_s"):
        StartGateConfig(image_rate_per_s=-1)


async def test_a_burst_of_cold_leases_all_start(backend: SandboxBackend, short_tmp: Path) -> None:
    """Twice as many cold leases as fit at once, all asked for together: the gate queues them,
    every one starts and answers, and no start waits on a timeout."""
    n = 16 if isinstance(backend, ApptainerBackend) else 48
    pool = WarmPool(backend, warm_specs={}, start_gate=StartGateConfig(concurrency=4))
    await pool.start()
    spec = SandboxSpec(ipython=False)
    try:
        async with asyncio.timeout(600):
            leases = await asyncio.gather(*(pool.lease(spec) for _ in range(n)))
            answers = await asyncio.gather(*(lease.run("echo up") for lease in leases))
        assert [a.output for a in answers] == ["up\n"] * n
        assert pool.counters["cold_starts"] == n and pool.counters["start_failures"] == 0
        assert pool.start_gate.max_waiting_seen >= n // 2 and pool.counters["start_wait_s"] > 0
        for lease in leases:
            await pool.release(lease)
    finally:
        await pool.close()
