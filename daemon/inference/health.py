"""Which servers of an inference pool are usable: a failing call or probe takes a server out, a
passing probe brings it back; a background probe loop, and faster probes while no server is left.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rolloutd.daemon.inference.base import InferenceBackend
from rolloutd.native_io.errors import InferenceError

logger = logging.getLogger(__name__)

RECOVERY_FIRST_S = 0.25
RECOVERY_MAX_S = 5.0
"""While no server is usable, the ones out are probed this often: first, and at the longest."""


@dataclass(eq=False)
class PoolServer:
    """One server of a pool, with what the pool knows of it."""

    backend: InferenceBackend
    healthy: bool = True
    removed: bool = False
    dispatched: int = 0
    completed: int = 0
    failures: int = 0
    last_error: str = ""
    slow_probes: int = 0
    """Slow health probes in a row since a call last completed here."""
    weight_version: str = ""
    calls: set[str] = field(default_factory=set)
    """Request ids in flight here: :meth:`ServerPool.remove_server` aborts them on the server."""
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def address(self) -> str:
        return self.backend.address

    @property
    def in_flight(self) -> int:
        return len(self.calls)

    @property
    def usable(self) -> bool:
        return self.healthy and not self.removed

    def status(self) -> dict[str, Any]:
        return {"address": self.address, "kind": self.backend.kind, "healthy": self.healthy, "removed": self.removed,
                "in_flight": self.in_flight, "dispatched": self.dispatched, "completed": self.completed,
                "failures": self.failures, "last_error": self.last_error, "weight_version": self.weight_version}


class ServerHealth:
    def __init__(self, servers: dict[str, PoolServer], interval_s: float, slow_probes_to_remove: int) -> None:
        self._servers = servers
        """The pool's own table, read live."""
        self._interval_s = interval_s
        self._slow_probes_to_remove = slow_probes_to_remove
        self.usable_again = asyncio.Event()
        """Set whenever a server becomes usable (added, or back from a failure)."""
        self._loop_task: asyncio.Task[None] | None = None
        self._recovery_task: asyncio.Task[None] | None = None

    def server_added(self) -> None:
        self.usable_again.set()
        if self._loop_task is None and self._interval_s > 0:
            self._loop_task = asyncio.create_task(self._loop(), name="inference-health")

    def take_out(self, server: PoolServer, error: InferenceError) -> None:
        server.healthy = False
        server.failures += 1
        server.last_error = str(error)
        logger.warning("taking %s out of the pool: %s", server.address, error)

    async def check(self) -> dict[str, bool]:
        """Probe every server once: failing ones go out, recovered ones come back, slow ones
        stay until they have been slow ``slow_probes_to_remove`` times in a row."""
        servers = [s for s in self._servers.values() if not s.removed]
        results = await asyncio.gather(*(s.backend.probe() for s in servers))
        for server, state in zip(servers, results):
            if state == "slow" and server.healthy:
                server.slow_probes += 1
                if server.slow_probes < self._slow_probes_to_remove:
                    logger.info("%s answered its health check late (%d in a row); kept in the pool",
                                server.address, server.slow_probes)
                    continue
            ok = state == "ok"
            if ok:
                server.slow_probes = 0
            if ok and not server.healthy:
                logger.info("%s passed its health check; back in the pool", server.address)
                self.usable_again.set()
            elif not ok and server.healthy:
                server.last_error = "health check failed" if state == "down" else \
                    f"health check answered late {server.slow_probes} times in a row"
                logger.warning("%s failed its health check (%s); taken out of the pool", server.address, state)
            server.healthy = ok
        return {s.address: s.healthy for s in servers}

    async def on_all(self, what: str, call: Callable[[PoolServer], Awaitable[Any]]) -> None:
        """``call`` on every server not removed; those that fail are taken out, then it raises."""
        servers = [s for s in self._servers.values() if not s.removed]
        results = await asyncio.gather(*(call(s) for s in servers), return_exceptions=True)
        errors = [(s, r) for s, r in zip(servers, results) if isinstance(r, BaseException)]
        for server, error in errors:
            if not isinstance(error, InferenceError):
                raise error
            self.take_out(server, error)
        if errors:
            raise InferenceError(f"{what} failed on {len(errors)} of {len(servers)} server(s) (taken out): "
                                 + "; ".join(f"{s.address}: {e}" for s, e in errors))

    def describe(self) -> str:
        if not self._servers:
            return "empty"
        return ", ".join(f"{s.address} {'ok' if s.usable else 'out'}"
                         f"{': ' + s.last_error[:120] if s.last_error else ''}" for s in self._servers.values())

    def context_limit(self) -> int | None:
        """The smallest context window a usable server reports; None when none reports one."""
        limits = [s.backend.max_model_len for s in self._servers.values()
                  if s.usable and s.backend.max_model_len]
        return min(limits) if limits else None

    async def wait_for(self, choose: Callable[[], PoolServer | None], until: float) -> PoolServer | None:
        """``choose()``'s server as soon as one is usable again (the ones out are probed), until
        the loop time ``until``; None when none came back."""
        self.recover_until(until)
        loop = asyncio.get_running_loop()
        while loop.time() < until:
            self.usable_again.clear()
            server = choose()
            if server is not None:
                return server
            try:
                async with asyncio.timeout_at(until):
                    await self.usable_again.wait()
            except TimeoutError:
                break
        return choose()

    def recover_until(self, until: float) -> None:
        """Probe the servers that are out until one is usable or the loop time ``until``."""
        if self._recovery_task is None or self._recovery_task.done():
            self._recovery_task = asyncio.get_running_loop().create_task(
                self._probe_until_usable(until), name="inference-recovery")

    async def _probe_until_usable(self, until: float) -> None:
        """Probe the servers that are out, ``RECOVERY_FIRST_S`` apart at first, doubling up to ``RECOVERY_MAX_S``."""
        loop = asyncio.get_running_loop()
        interval = RECOVERY_FIRST_S
        while loop.time() < until and not any(s.usable for s in self._servers.values()):
            await asyncio.sleep(min(interval, max(0.0, until - loop.time())))
            await self.check()
            interval = min(interval * 2, RECOVERY_MAX_S)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self.check()

    async def close(self) -> None:
        for task in (self._loop_task, self._recovery_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._loop_task = self._recovery_task = None
