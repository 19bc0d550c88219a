"""A pool of inference servers of any kind behind one ``generate``.

Routing: a trajectory's turns stay on the server that served its first turn (so the server's
prefix cache holds its history); a new trajectory goes to the healthy server with the fewest
calls in flight. Servers are added and removed at run time, and a background health check takes
failing servers out and puts recovered ones back.

Failures: when a server fails a call (connection lost, HTTP 5xx, an answer that breaks the
protocol) it is taken out and the WHOLE turn starts again on another server: partial output is
never spliced, so the tokens returned are always one server's uninterrupted sample. A deadline
covers all attempts; cancelling a call aborts it on the server. When no server is left, a turn
waits up to ``server_wait_s`` for one to come back (a restarting vLLM takes a minute), while the
servers that are out are probed with a growing interval; past that it fails with
NoInferenceServer naming each server's last error.

Health: a probe that is refused or answers an error takes a server out at once; one that only
answers late (``slow``: a server busy generating) takes it out only after
``slow_probes_to_remove`` slow probes in a row with no call completing there meanwhile.

Context: :meth:`ServerPool.context_limit` is the smallest ``max_model_len`` the servers report,
so an agent can size its turns to what every server accepts.

Weight updates: :meth:`pause_all` pauses every server (vLLM ``/pause?mode=keep``, SGLang
``/pause_generation``) and holds new calls in the pool; :meth:`resume_all` resumes them. Every
result carries a weight version: the server's own where the protocol reports one (vLLM's
per-token spans, SGLang's label), otherwise the version set with :meth:`set_weight_version` when
the call was sent; and ``straddled`` where a version change fell inside the call.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import OrderedDict
from typing import Any
from collections.abc import Sequence

import numpy as np

from rolloutd.daemon.inference.base import GenerateResult, InferenceBackend, SamplingParams
from rolloutd.daemon.inference.factory import make_backend
from rolloutd.daemon.inference.health import PoolServer, ServerHealth
from rolloutd.native_io.errors import (
    ConfigError,
    InferenceError,
    InferenceRejected,
    InferenceTimeout,
    NoInferenceServer,
    NotFound,
)

logger = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 10.0
"""How long a removed server's aborted calls may take to stop before it is closed anyway."""


def _cancelling() -> bool:
    """Whether the running task itself is being cancelled (by its caller or a timeout)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def label_versions(result: GenerateResult, sent: str, *, straddled: bool) -> None:
    """The versions a result holds: the server's per-token spans where it reports them, else the
    version the call was sent under (not the one current when it came back), and whether a
    version change fell inside the call (``straddled``: the pool's version changed meanwhile)."""
    result.sent_version = sent
    if result.weight_spans:
        result.straddled = len({s.version for s in result.weight_spans}) > 1
        return
    result.straddled = straddled
    if not result.weight_version:
        result.weight_version = sent


class ServerPool:
    def __init__(self, *, api_key: str | None = None, max_attempts: int = 3, health_interval_s: float = 5.0,
                 weight_version: str = "0", max_sticky: int = 100_000, server_wait_s: float = 0.0,
                 slow_probes_to_remove: int = 3, http_options: dict[str, Any] | None = None) -> None:
        """``health_interval_s`` 0 turns the background health check off (:meth:`check_health`
        still works); ``max_sticky`` bounds how many trajectories the pool remembers;
        ``server_wait_s`` is how long a turn waits for a server when none is usable."""
        if max_attempts < 1:
            raise ConfigError(f"max_attempts must be >= 1, got {max_attempts}")
        if not server_wait_s >= 0 or slow_probes_to_remove < 1:
            raise ConfigError(f"server_wait_s must be >= 0 and slow_probes_to_remove >= 1, got "
                              f"{server_wait_s!r} and {slow_probes_to_remove!r}")
        self._server_wait_s = server_wait_s
        self._api_key = api_key
        self._max_attempts = max_attempts
        self._weight_version = weight_version
        self._version_epoch = 0
        """Bumped by every :meth:`set_weight_version`: a call that sees it change straddled one."""
        self._max_sticky = max_sticky
        self._http_options = http_options or {}
        self._servers: dict[str, PoolServer] = {}
        self._health = ServerHealth(self._servers, health_interval_s, slow_probes_to_remove)
        self._sticky: OrderedDict[str, str] = OrderedDict()
        self._resumed = asyncio.Event()
        self._resumed.set()

    @classmethod
    async def create(cls, specs: Sequence[str | InferenceBackend], keys: dict[str, str] | None = None,
                     **options: Any) -> ServerPool:
        """A pool of ``specs``; ``keys`` gives some of them their own bearer token."""
        pool = cls(**options)
        try:
            for spec in specs:
                await pool.add_server(spec, api_key=(keys or {}).get(spec) if isinstance(spec, str) else None)
        except BaseException:
            await pool.close()
            raise
        return pool

    async def __aenter__(self) -> ServerPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- membership --------------------------------------------------------------------------

    async def add_server(self, spec: str | InferenceBackend, *, api_key: str | None = None) -> str:
        """Add a server (a spec for :func:`make_backend`, or a backend); returns its address.
        ``api_key``: its bearer token, when not the pool's."""
        backend = spec if isinstance(spec, InferenceBackend) else await make_backend(
            spec, api_key=api_key or self._api_key, **self._http_options)
        if backend.address in self._servers:
            if backend is not self._servers[backend.address].backend:
                await backend.close()
            raise ConfigError(f"{backend.address} is already in the pool")
        server = PoolServer(backend=backend)
        server.idle.set()
        self._servers[backend.address] = server
        self._health.server_added()
        logger.info("added %s server %s (%d in the pool)", backend.kind, backend.address, len(self._servers))
        return backend.address

    async def remove_server(self, address: str, *, drain_timeout_s: float = 0.0) -> None:
        """Stop sending calls to ``address``; calls still running there after
        ``drain_timeout_s`` are aborted and their turns started again on other servers (the
        turns' own tasks go on undisturbed); then close it."""
        server = self._servers.get(address)
        if server is None:
            raise NotFound(f"{address} is not in the pool (servers: {sorted(self._servers)})")
        server.removed = True
        for tid in [t for t, a in self._sticky.items() if a == address]:
            del self._sticky[tid]
        if server.in_flight and drain_timeout_s > 0:
            try:
                async with asyncio.timeout(drain_timeout_s):
                    await server.idle.wait()
            except TimeoutError:
                logger.info("%s still has %d calls after %.1fs of draining; moving them", address,
                            server.in_flight, drain_timeout_s)
        for call in server.calls.values():
            call.cancel(f"rolloutd: inference server {address} was removed from the pool")
        if server.in_flight:
            try:
                async with asyncio.timeout(ABORT_TIMEOUT_S):
                    await server.idle.wait()
            except TimeoutError:
                logger.warning("%d calls on removed server %s did not stop within %gs (ABORT_TIMEOUT_S)",
                               server.in_flight, address, ABORT_TIMEOUT_S)
        del self._servers[address]
        await server.backend.close()
        logger.info("removed %s (%d servers left)", address, len(self._servers))

    def release_trajectory(self, trajectory_id: str) -> None:
        """Forget which server a finished trajectory used."""
        self._sticky.pop(trajectory_id, None)

    # --- generation --------------------------------------------------------------------------

    def _choose(self, trajectory_id: str) -> PoolServer | None:
        address = self._sticky.get(trajectory_id)
        if address is not None:
            server = self._servers.get(address)
            if server is not None and server.usable:
                return server
        best: PoolServer | None = None
        for server in self._servers.values():
            # Fewest calls in flight; ties go to the server that got fewer calls so far.
            if server.usable and (best is None or (server.in_flight, server.dispatched)
                                  < (best.in_flight, best.dispatched)):
                best = server
        if best is not None:
            self._sticky[trajectory_id] = best.address
            if len(self._sticky) > self._max_sticky:
                self._sticky.popitem(last=False)
        return best

    async def generate(self, prompt_ids: Sequence[int] | np.ndarray, params: SamplingParams, *,
                       trajectory_id: str, timeout_s: float, request_id: str | None = None) -> GenerateResult:
        """One turn of ``trajectory_id``; ``timeout_s`` is the deadline for all attempts."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        base_id = request_id or f"{trajectory_id}-{uuid.uuid4().hex[:12]}"
        if not self._resumed.is_set():
            await self._wait_resumed(deadline, base_id)
        failures: list[InferenceError] = []
        attempt = 0
        # Failed attempts count against max_attempts; turns moved off a removed server do not.
        while len(failures) < self._max_attempts:
            server = self._choose(trajectory_id)
            if server is None:
                server = await self._wait_for_server(trajectory_id, deadline)
            if server is None:
                break
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise InferenceTimeout(f"turn {base_id} ran out of its {timeout_s:.1f}s deadline after "
                                       f"{attempt} attempt(s); raise timeout_s")
            rid = base_id if attempt == 0 else f"{base_id}-retry{attempt}"
            attempt += 1
            sent, epoch = self._weight_version, self._version_epoch
            call = loop.create_task(server.backend.generate(prompt_ids, params, request_id=rid, timeout_s=remaining),
                                    name=f"inference-{rid}")
            server.calls[rid] = call
            server.in_flight += 1
            server.dispatched += 1
            server.idle.clear()
            try:
                # Awaiting the call: a cancel of this turn reaches the call and waits for its abort.
                result = await call
            except asyncio.CancelledError:
                if server.removed and call.cancelled() and not _cancelling():
                    # remove_server aborted the call, not the turn's caller: the turn moves.
                    logger.info("turn %s moved off removed server %s", rid, server.address)
                    self._sticky.pop(trajectory_id, None)
                    continue
                raise
            except (InferenceTimeout, InferenceRejected):
                raise
            except InferenceError as e:
                self._health.take_out(server, e)
                self._sticky.pop(trajectory_id, None)
                failures.append(e)
                continue
            finally:
                del server.calls[rid]
                server.in_flight -= 1
                if server.in_flight == 0:
                    server.idle.set()
            label_versions(result, sent, straddled=self._version_epoch != epoch)
            if result.weight_version:
                server.weight_version = result.weight_version
            server.completed += 1
            server.slow_probes = 0
            return result
        if failures:
            last = failures[-1]
            why = f"max_attempts={self._max_attempts} was reached" if len(failures) >= self._max_attempts else \
                "no other healthy server was left" + (f", and none came back within server_wait_s="
                                                      f"{self._server_wait_s:g}" if self._server_wait_s else "")
            last.add_note(f"rolloutd pool: turn {base_id} failed on {len(failures)} server(s) "
                          f"({'; '.join(str(f) for f in failures[:-1]) or 'no earlier failure'}); {why}")
            raise last
        raise NoInferenceServer(f"no healthy inference server for turn {base_id} "
                                f"(pool: {self._health.describe()}); add servers or wait for the health check")

    async def _wait_for_server(self, trajectory_id: str, deadline: float) -> PoolServer | None:
        """A usable server once one comes back, within ``server_wait_s`` and the deadline."""
        if self._server_wait_s <= 0 or not self._servers:
            return None
        until = min(deadline, asyncio.get_running_loop().time() + self._server_wait_s)
        return await self._health.wait_for(lambda: self._choose(trajectory_id), until)

    async def _wait_resumed(self, deadline: float, base_id: str) -> None:
        try:
            async with asyncio.timeout_at(deadline):
                await self._resumed.wait()
        except TimeoutError as e:
            raise InferenceTimeout(f"turn {base_id} waited for the paused pool (weight update) past its "
                                   "deadline; raise timeout_s or resume the pool sooner") from e

    # --- weights and control -----------------------------------------------------------------

    async def set_weight_version(self, version: str) -> None:
        """Label the current weights ``version``: on every server whose protocol reports a label
        (so its per-token versions say it from now on), and for results from servers that report
        none."""
        self._weight_version = str(version)
        self._version_epoch += 1
        await self._health.on_all("set_weight_version", lambda s: s.backend.set_weight_version(self._weight_version))

    @property
    def weight_version(self) -> str:
        return self._weight_version

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    async def pause_all(self, mode: str = "keep") -> None:
        """Pause every server; new calls wait in the pool until :meth:`resume_all`."""
        self._resumed.clear()
        await self._health.on_all("pause", lambda s: s.backend.pause(mode))

    async def resume_all(self) -> None:
        await self._health.on_all("resume", lambda s: s.backend.resume())
        self._resumed.set()

    async def check_health(self) -> dict[str, bool]:
        """Probe every server once (see :meth:`ServerHealth.check`); address -> usable."""
        return await self._health.check()

    def context_limit(self) -> int | None:
        """The smallest context window a usable server reports; None when none reports one."""
        return self._health.context_limit()

    def status(self) -> dict[str, Any]:
        return {
            "paused": self.paused,
            "weight_version": self._weight_version,
            "sticky_trajectories": len(self._sticky),
            "servers": [s.status() for s in self._servers.values()],
        }

    async def close(self) -> None:
        await self._health.close()
        servers = list(self._servers.values())
        self._servers.clear()
        await asyncio.gather(*(s.backend.close() for s in servers), return_exceptions=True)
