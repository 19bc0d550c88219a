"""The gateway's state and operations, behind the HTTP routes: running or not, the inference
servers it added to the node, the jobs waiting for their trajectory.

As with the published server, jobs are refused until ``start``; inference servers added while
stopped are kept and applied at ``start``; ``stop`` cancels every pending job and takes the
servers it added out of the node again (they are applied anew at the next ``start``). Servers the
node was started with are left alone: ``clear_servers`` removes only what this gateway added.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from rolloutd.client.async_client import AsyncRolloutClient, RolloutRequest, RolloutResult
from rolloutd.native_io.errors import (
    BadRequest,
    Cancelled,
    DaemonUnavailable,
    NoInferenceServer,
    NotFound,
    OperationTimeout,
    RolloutdError,
    ShuttingDown,
)
from rolloutd.native_io.trajectory import Trajectory

from .compat import prorl_answer
from .mapping import DataSources, result_json, rollout_request, server_address, unstarted_trajectory
from .params import translate

log = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 120.0
"""How long a timed-out job's cancelled answer is awaited (to give its shared memory back)."""
_KIND_PREFIX = re.compile(r"^[a-z-]+\+")


@dataclass
class GatewayConfig:
    address: str
    """The node daemon or router the gateway forwards to (``ipc://...`` or ``tcp://...``)."""
    timeout_s: float = 300.0
    """Stage time one job may use (init + run + eval; queue waits are not counted), like the
    published server's ``--timeout``."""
    process_wait_s: float | None = None
    """How long ``/process`` waits before it answers 504 and cancels the job; None: 2 x timeout_s + 10."""
    sources: DataSources = field(default_factory=DataSources)
    control_timeout_s: float = 30.0
    """Deadline of each call to the node that is not a rollout (status, inference servers)."""
    prorl: bool = True
    """The published server's request and answer shapes (the default); False: rolloutd's own
    (``--mode native``: sampling_params optional and in rolloutd's names, no ``messages``)."""
    tokenizer: Any = None
    """The node's tokenizer (``--tokenizer``), to give ``messages`` their text; None: empty text."""

    @property
    def wait_s(self) -> float:
        return 2 * self.timeout_s + 10 if self.process_wait_s is None else self.process_wait_s


@dataclass
class Job:
    job_id: str
    request_id: str
    submitted_at: float
    cancelled: bool = False
    """Cancelled here (``cancel``, ``stop`` or the wait ran out), so a Cancelled answer is expected."""
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    """Set by ``stop``: its ``/process`` answers 503 at once, without waiting for the node."""


class Gateway:
    def __init__(self, config: GatewayConfig, client: AsyncRolloutClient | None = None) -> None:
        self.config = config
        self.client = client or AsyncRolloutClient(config.address, timeout_s=config.control_timeout_s)
        self.running = False
        self.buffered: list[str] = []
        """Server specs to apply at ``start`` (also those applied now)."""
        self.added: dict[str, str] = {}
        """Spec -> the address the node's pool knows it by, for what this gateway added."""
        self.jobs: dict[str, Job] = {}
        self._background: set[asyncio.Task[None]] = set()

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> dict[str, Any]:
        if self.running:
            raise BadRequest("the gateway is already running; POST /stop first to restart it")
        try:
            await self.client.status(timeout_s=self.config.control_timeout_s)
        except RolloutdError as e:
            raise DaemonUnavailable(f"the node daemon at {self.config.address} did not answer ({e.code}: {e}); "
                                    "start it (rolloutd node start) or pass the right --address") from e
        errors = {}
        for spec in self.buffered:
            try:
                await self._add(spec)
            except RolloutdError as e:
                errors[spec] = f"{e.code}: {e}"
        self.running = True
        log.info("started: forwarding to %s with inference servers %s", self.config.address, sorted(self.added))
        return {"status": "started", "llm_servers": sorted(self.added), "llm_server_errors": errors}

    async def stop(self, *, within_s: float | None = None) -> dict[str, Any]:
        """Cancel the pending jobs (their ``/process`` answers 503 at once) and take this gateway's
        servers out of the node, giving up on the node after ``within_s`` (a shutdown must not wait
        on a hung node; the default is each call's control time-out)."""
        self.running = False
        jobs = list(self.jobs.values())
        for job in jobs:
            job.cancelled = True
            job.stopped.set()
            await self.client.cancel(job.request_id)
        try:
            async with asyncio.timeout(within_s):
                errors = await self._remove_added()
        except TimeoutError:
            errors = {spec: f"the node did not answer within {within_s:g} s" for spec in self.added}
        log.info("stopped: cancelled %d pending jobs", len(jobs))
        return {"status": "stopped", "cancelled_jobs": sorted(j.job_id for j in jobs), "llm_server_errors": errors}

    async def close(self, *, drain_s: float = DRAIN_TIMEOUT_S) -> None:
        """Stop (when running), wait up to ``drain_s`` for the cancelled answers, close the client
        (the node then frees what is left of them)."""
        if self.running:
            await self.stop()
        if self._background:
            await asyncio.wait(self._background, timeout=drain_s)
            for task in self._background:
                task.cancel()
        await self.client.close()

    # --- inference servers ----------------------------------------------------------------------

    async def add_server(self, address: Any) -> dict[str, Any]:
        spec = server_address(address)
        if self.running and spec not in self.added:
            await self._add(spec)
        if spec not in self.buffered:
            self.buffered.append(spec)
        return {"status": "added" if self.running else "buffered until /start", "address": spec}

    async def clear_servers(self) -> dict[str, Any]:
        errors = await self._remove_added()
        self.buffered.clear()
        return {"status": "cleared", "llm_server_errors": errors}

    async def _add(self, spec: str) -> None:
        await self.client.add_inference_server(spec)
        self.added[spec] = _KIND_PREFIX.sub("", spec)

    async def _remove_added(self) -> dict[str, str]:
        errors = {}
        for spec, address in list(self.added.items()):
            try:
                await self.client.remove_inference_server(address)
            except NotFound:
                pass  # someone else took it out already
            except RolloutdError as e:
                errors[spec] = f"{e.code}: {e}"
                continue
            del self.added[spec]
        return errors

    async def _has_inference_server(self) -> bool:
        if self.added:
            return True
        try:
            status = await self.client.status(timeout_s=self.config.control_timeout_s)
        except RolloutdError as e:
            raise DaemonUnavailable(f"the node daemon at {self.config.address} does not answer ({e.code}: {e})") from e
        servers = node_servers(status)
        return servers is None or bool(servers)

    # --- jobs -----------------------------------------------------------------------------------

    async def process(self, instance: dict[str, Any], sampling_params: dict[str, Any] | None,
                      job_id: str | None) -> dict[str, Any]:
        """Run one job to its end; its trajectory as JSON, or the error that maps to the HTTP status."""
        notes: list[str] = []
        sampling = sampling_params or {}
        if self.config.prorl:
            translated = translate(sampling)
            sampling = translated.params
            notes = [n for n in (translated.note(),) if n]
        request = rollout_request(instance, sampling, self.config.sources, timeout_s=self.config.timeout_s,
                                  prorl=self.config.prorl)
        job_id = job_id or uuid.uuid4().hex
        if job_id in self.jobs:
            raise BadRequest(f"job {job_id!r} is already pending; give each job its own job_id")
        if not await self._has_inference_server():
            raise NoInferenceServer('no inference server is registered: POST /add_llm_server {"address": ...}')
        (rid,) = await self.client.submit([request])
        job = self.jobs[job_id] = Job(job_id, rid, time.monotonic())
        try:
            results = await self._results(job)
        except OperationTimeout as e:
            job.cancelled = True
            self._drain(rid)
            raise OperationTimeout(f"Processing timed out: job {job_id} did not finish within "
                                   f"{self.config.wait_s:g} s (2 x timeout_s + 10, or --process-wait-s); it was "
                                   "cancelled") from e
        except asyncio.CancelledError:
            await self.client.cancel(rid)
            self._drain(rid)
            raise
        finally:
            self.jobs.pop(job_id, None)
        try:
            return await self._answer(job, request, instance, results[rid], notes)
        finally:
            await self.client.release(results[rid])

    async def _results(self, job: Job) -> dict[str, RolloutResult]:
        """The job's answer, or ShuttingDown as soon as ``stop`` is called (a hung or busy node must
        not hold the stop; the cancelled answer is collected in the background)."""
        fetch = asyncio.ensure_future(self.client.results([job.request_id], timeout_s=self.config.wait_s))
        stopped = asyncio.ensure_future(job.stopped.wait())
        try:
            await asyncio.wait({fetch, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            if not fetch.done():
                fetch.cancel()
        if fetch.done() and not fetch.cancelled():
            return fetch.result()
        self._drain(job.request_id)
        raise ShuttingDown(f"the gateway was stopped (POST /stop or SIGTERM) while job {job.job_id} ran; it was "
                           "cancelled")

    async def _answer(self, job: Job, request: RolloutRequest, instance: dict[str, Any],
                      result: RolloutResult, notes: list[str]) -> dict[str, Any]:
        if job.stopped.is_set():
            raise ShuttingDown(f"the gateway was stopped (POST /stop) while job {job.job_id} ran; it was cancelled")
        if job.cancelled and (isinstance(result.error, Cancelled) or not result.trajectories):
            trajectory = unstarted_trajectory(job.request_id, request)
        elif result.error is not None:
            raise result.error
        elif len(result.trajectories) != 1:
            raise RolloutdError(f"job {job.job_id}: the node answered {len(result.trajectories)} trajectories, not 1")
        else:
            trajectory = result.trajectories[0]
        if trajectory.error_code == NoInferenceServer.code:
            raise NoInferenceServer(trajectory.error_message or "no inference server")
        return await asyncio.to_thread(self._json, trajectory, job, instance, notes)

    def _json(self, trajectory: Trajectory, job: Job, instance: dict[str, Any], notes: list[str]) -> dict[str, Any]:
        native = result_json(trajectory, job_id=job.job_id, instance=instance, wall_s=time.monotonic() - job.submitted_at)
        return prorl_answer(native, trajectory, notes, self.config.tokenizer) if self.config.prorl else native

    async def cancel(self, job_id: Any) -> dict[str, Any]:
        if not isinstance(job_id, str):
            raise BadRequest('send {"job_id": "<the job_id given to /process>"}')
        job = self.jobs.get(job_id)
        if job is not None:
            job.cancelled = True
            await self.client.cancel(job.request_id)
        return {"status": f"cancel requested for job {job_id}", "pending": job is not None}

    async def status(self) -> dict[str, Any]:
        now = time.monotonic()
        try:
            node: dict[str, Any] = await self.client.status(timeout_s=self.config.control_timeout_s)
        except RolloutdError as e:
            node = {"error": f"{e.code}: {e}"}
        return {"status": "running", "pending_jobs": len(self.jobs),
                "jobs": {j.job_id: {"waiting_s": now - j.submitted_at} for j in self.jobs.values()},
                "llm_servers": sorted(self.added), "address": self.config.address,
                "timeout_s": self.config.timeout_s, "process_wait_s": self.config.wait_s,
                "data_sources": sorted(self.config.sources.datasets), "node": node}

    def _drain(self, request_id: str) -> None:
        """Collect a cancelled job's answer in the background so its shared memory goes back."""
        async def drain() -> None:
            try:
                results = await self.client.results([request_id], timeout_s=DRAIN_TIMEOUT_S)
                await self.client.release(results[request_id])
            except RolloutdError as e:
                log.warning("the cancelled request %s gave no answer: %s", request_id, e)

        task = asyncio.get_running_loop().create_task(drain())
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def node_servers(status: dict[str, Any]) -> set[str] | None:
    """Inference servers the node's workers report, or None when the status does not say (a router,
    or workers that have not reported yet)."""
    found: set[str] | None = None
    for worker in status.get("workers") or []:
        inference = (worker.get("pipeline") or {}).get("inference") if isinstance(worker, dict) else None
        if isinstance(inference, dict):
            found = (found or set()) | {s.get("address", "") for s in inference.get("servers", [])
                                        if not s.get("removed")}
    return found
