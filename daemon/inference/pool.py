"""A pool of inference servers of any kind behind one ``generate``.

Routing: a trajectory's turns stay on the server that served its first turn (so the server's
prefix cache holds its history); a new trajectory goes to the healthy server with the fewest
calls in flight. Servers are added and removed at run time, and a background health check takes
failing servers out and puts recovered ones back. Removing a server aborts its calls through the
server's own abort route; each turn, awaiting its call in its own task, sees it end (finish
reason ``abort``, or an error once the server is closed) and starts again on another server.

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
import contextlib
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
"""How long a removed server's aborted calls may take to stop before its connections are closed."""
ABORT_REPEAT_S = 0.5
"""How often the aborts of a removed server's calls that are still running are sent again."""


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

    async def remove_server(self, address: str, *, drain_timeout_s: float = 0.0,
                            abort_timeout_s: float = ABORT_TIMEOUT_S) -> None:
        """Stop sending calls to ``address``; calls still running there after
        ``drain_timeout_s`` are aborted on the server (its abort route) and their turns start
        again on other servers; then it is closed, which also ends calls that did not stop
        within ``abort_timeout_s``. No task is cancelled: each turn sees its call end."""
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
        if server.in_flight:
            await _abort_calls(server, abort_timeout_s)
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
            server.calls.add(rid)
            server.dispatched += 1
            server.idle.clear()
            try:
                # Awaited in the turn's own task (a task per call cost ~3 ms of scheduling at 256
                # in flight); cancelling the turn aborts the call on the server (the backend's rule).
                result = await server.backend.generate(prompt_ids, params, request_id=rid, timeout_s=remaining)
            except (InferenceTimeout, InferenceRejected):
                raise
            except InferenceError as e:
                if server.removed:  # closed by remove_server after its abort timeout
                    self._moved(rid, server, trajectory_id, e)
                    continue
                self._health.take_out(server, e)
                self._sticky.pop(trajectory_id, None)
                failures.append(e)
                continue
            finally:
                server.calls.discard(rid)
                if not server.calls:
                    server.idle.set()
            if server.removed and result.finish_reason == "abort":
                self._moved(rid, server, trajectory_id, "aborted")
                continue
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

    def _moved(self, rid: str, server: PoolServer, trajectory_id: str, why: object) -> None:
        """A turn whose call ended because its server was removed starts again elsewhere (not a
        failure: it does not count against max_attempts)."""
        logger.info("turn %s moved off removed server %s (%s)", rid, server.address, why)
        self._sticky.pop(trajectory_id, None)

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


async def _abort_calls(server: PoolServer, timeout_s: float) -> None:
    """Abort every call in flight on the removed ``server`` and wait, up to ``timeout_s``, for
    them to end (each ends with finish reason ``abort`` and its turn moves). The aborts of calls
    still running go again every ``ABORT_REPEAT_S``: vLLM ignores an abort of an id its engine
    has not admitted yet, and says neither when it admits one nor that it ignored the abort."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    logger.info("aborting %d calls on removed server %s", server.in_flight, server.address)
    try:
        async with asyncio.timeout_at(deadline):
            while server.in_flight:
                rids = sorted(server.calls)
                results = await asyncio.gather(*(server.backend.abort(rid) for rid in rids), return_exceptions=True)
                for rid, result in zip(rids, results):
                    if isinstance(result, BaseException):
                        # Closing the server's connections (last) ends the call all the same.
                        logger.info("abort of %s on removed server %s failed: %s", rid, server.address, result)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(ABORT_REPEAT_S):
                        await server.idle.wait()
    except TimeoutError:
        logger.warning("%d calls on removed server %s did not stop within %gs of their abort "
                       "(abort_timeout_s); closing its connections", server.in_flight, server.address, timeout_s)
