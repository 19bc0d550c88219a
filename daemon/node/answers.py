"""A worker's answers to requests: each request gets one, a reply or an error a user can act on."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from rolloutd.native_io import framing
from rolloutd.native_io.errors import Cancelled, RolloutdError
from rolloutd.native_io.wire import MsgType

log = logging.getLogger(__name__)

Answer = Callable[[list[Any]], None]
"""Where a request's one answer goes (the supervisor's link, or the client's)."""


def as_error(rid: str, e: BaseException, worker_index: int) -> RolloutdError:
    """What a request's caller is told of the exception that ended it."""
    if isinstance(e, asyncio.CancelledError):
        return Cancelled(f"request {rid} was cancelled")
    if isinstance(e, RolloutdError):
        return e
    # A bug must still answer the request.
    log.error("worker %d: request %s failed", worker_index, rid, exc_info=e)
    return RolloutdError(f"internal error in worker {worker_index}: {e!r}")


def reply_frames(rid: str, result: dict[str, Any], refs: list[dict[str, Any]] | None = None,
                 buffers: list[Any] | None = None) -> list[Any]:
    """A request's reply: its result, and the references to its arrays (in ``buffers`` or shared memory)."""
    return framing.encode(MsgType.REPLY, {"id": rid, "result": result, "refs": refs or []}, buffers)


def send_error(answer: Answer, rid: str, e: RolloutdError) -> None:
    answer(framing.encode(MsgType.ERROR, {"id": rid, "code": e.code, "message": str(e), "details": _plain(e.details)}))


def _plain(details: dict[str, Any]) -> dict[str, Any]:
    """Details as msgpack-able values (anything else becomes its repr)."""
    out = {}
    for k, v in details.items():
        out[str(k)] = v if isinstance(v, (str, int, float, bool, type(None), list, dict)) else repr(v)
    return out


Handler = Callable[[Any, dict[str, Any]], Awaitable[tuple[dict[str, Any], dict[str, np.ndarray]]]]
"""A request's handler: (its parsed args, its header) -> (its result, its arrays)."""
