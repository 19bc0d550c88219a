"""The client's rollout calls: submit rollouts without waiting, then take their results in
completion order (a part of :class:`~rolloutd.client.async_client.AsyncRolloutClient`, which
re-exports the types here); and the reply every call of the client gets."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rolloutd.native_io.errors import OperationTimeout, RolloutdError
from rolloutd.native_io.trajectory import Trajectory, unpack_batch
from rolloutd.native_io.wire import RolloutArgs, RolloutOptions, TaskRef, to_fields

from .submitted import SubmittedRollouts

RESULT_MARGIN_S = 60.0
"""``as_completed`` without a timeout waits for the latest request's own ``timeout_s`` plus this."""


@dataclass
class Reply:
    result: dict[str, Any]
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    segments: list[str] = field(default_factory=list)
    """Shared-memory segments backing ``arrays``; give them back with ``release``."""


@dataclass(kw_only=True)
class RolloutRequest(RolloutOptions):
    """One task to roll out ``n`` times: ``task_id`` from ``dataset``, or a full ``task`` record;
    every other field (and its default) is ``wire.RolloutOptions``'s."""

    task_id: str = ""
    dataset: str = "bundled"
    task: dict[str, Any] | None = None
    """A full inline task record instead of ``task_id``/``dataset``."""
    request_id: str | None = None

    def to_args(self) -> dict[str, Any]:
        options = {f.name: getattr(self, f.name) for f in dataclasses.fields(RolloutOptions)}
        args: dict[str, Any] = to_fields(RolloutArgs(task=TaskRef(self.task_id, self.dataset, self.task), **options))
        return args


@dataclass
class RolloutResult:
    request_id: str
    trajectories: list[Trajectory]
    error: RolloutdError | None = None
    """Set when the whole request was refused or failed (e.g. BUSY, an unknown task)."""
    reply: "Reply | None" = None
    """The raw reply: pass the result to ``release`` once the arrays are no longer needed."""

    @property
    def trainable(self) -> list[Trajectory]:
        """The trajectories the model ended (``reward_valid``): the ones to train on."""
        return [t for t in self.trajectories if t.reward_valid]

    @property
    def shortfall(self) -> int:
        """Samples without a valid reward even after the daemon's refills (see ``ended_by``)."""
        return len(self.trajectories) - len(self.trainable)


class RolloutCalls:
    """Rollouts as a trainer submits and collects them; the client provides what is declared here."""

    _submitted: SubmittedRollouts[Reply]
    _waiters: dict[str, asyncio.Future[Reply]]

    async def _start(self, op: str, args: dict[str, Any] | None, request_id: str | None,
                     link: str | None = None) -> tuple[str, asyncio.Future[Reply]]:
        raise NotImplementedError

    async def cancel(self, request_id: str) -> None:
        raise NotImplementedError

    async def submit(self, requests: list[RolloutRequest]) -> list[str]:
        """Send rollout requests without waiting; returns their ids (answers come in any order)."""
        ids = []
        loop = asyncio.get_running_loop()
        for req in requests:
            rid, fut = await self._start("rollout", req.to_args(), req.request_id)
            self._submitted.add(rid, fut, loop.time() + req.timeout_s + RESULT_MARGIN_S)
            ids.append(rid)
        return ids

    async def as_completed(self, ids: list[str], *, timeout_s: float | None = None) -> AsyncIterator[RolloutResult]:
        """Results in completion order; a request that failed yields a result with ``error`` set.

        Without ``timeout_s`` it waits until the latest of the requests' own deadlines (their
        ``timeout_s``) plus RESULT_MARGIN_S: by then the daemon has answered, or is broken."""
        futs = {self._submitted.answer(rid): rid for rid in ids}
        loop = asyncio.get_running_loop()
        if timeout_s is None:
            deadline = self._submitted.latest_deadline(ids, default=loop.time())
            timeout_s = round(deadline - loop.time(), 1)
        else:
            deadline = loop.time() + timeout_s
        pending = set(futs)
        while pending:
            left = max(0.0, deadline - loop.time())
            done, pending = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                for fut in pending:
                    await self.cancel(futs[fut])
                raise OperationTimeout(f"{len(pending)} rollouts did not finish within {timeout_s} s (timeout_s); "
                                       "they were cancelled")
            for fut in done:
                yield self._result(futs[fut], fut, asked=ids.count(futs[fut]))

    async def results(self, ids: list[str], *, timeout_s: float | None = None) -> dict[str, RolloutResult]:
        return {r.request_id: r async for r in self.as_completed(ids, timeout_s=timeout_s)}

    def _result(self, rid: str, fut: asyncio.Future[Reply], asked: int = 1) -> RolloutResult:
        """``asked``: how many of the submits of ``rid`` this result answers (ids listed twice)."""
        another_waits = self._submitted.hand_out(rid, asked)
        self._waiters.pop(rid, None)
        exc = fut.exception()
        if exc is not None:
            if not isinstance(exc, RolloutdError):
                raise exc
            return RolloutResult(rid, [], error=exc)
        reply = fut.result()
        trajectories = unpack_batch(reply.result["trajectories"], reply.arrays)
        if another_waits:
            # Another submit of this id still waits for it: this one gets private copies, so the
            # last one's release cannot pull the shared memory from under it.
            return RolloutResult(rid, [t.copy() for t in trajectories])
        return RolloutResult(rid, trajectories, reply=reply)
