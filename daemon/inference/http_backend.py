"""What the vLLM and SGLang HTTP backends share: one keep-alive HTTP/1.1 client per server
(:mod:`rolloutd.daemon.inference.http1`), deadlines, aborts on cancel or timeout, and turning every
way a server can fail into an error that names the server and says what went wrong.

How failures map (the pool retries the InferenceError ones on another server):
- connection refused or reset, HTTP 5xx, 408, 429  -> InferenceError
  (a reused keep-alive connection that the server closed, as after its restart, is first retried
  once on a fresh connection by the client: that is our stale socket, not the server failing)
- an answer that is not the documented JSON (truncated, missing fields), HTTP 404 -> InferenceProtocolError
- HTTP 401/403 and other 4xx (the request itself is wrong) -> InferenceRejected
- no whole answer before the deadline                  -> InferenceTimeout (request aborted on the server)
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from abc import abstractmethod
from typing import Any
from collections.abc import Sequence
from urllib.parse import urlencode

import numpy as np
import orjson

from rolloutd.daemon.inference.base import InferenceBackend
from rolloutd.daemon.inference.growing_ids import GrowingIds
from rolloutd.daemon.inference.http1 import HTTP1Client
from rolloutd.native_io.errors import (
    ContextLengthExceeded,
    InferenceError,
    InferenceProtocolError,
    InferenceRejected,
    InferenceTimeout,
)

logger = logging.getLogger(__name__)

_RETRYABLE_4XX = frozenset({408, 429})
# vLLM's words for a prompt past max_model_len (both routes), SGLang's and the reference policy's.
_CONTEXT_LENGTH = re.compile(r"maximum (?:context|model) length|max_model_len|context length|too long", re.I)


class HTTPBackend(InferenceBackend):
    def __init__(self, base_url: str, *, api_key: str | None = None, connect_timeout_s: float = 5.0,
                 control_timeout_s: float = 30.0, health_timeout_s: float = 2.0,
                 max_connections: int = 0) -> None:
        """``max_connections`` 0 means unlimited: every in-flight turn holds one connection."""
        self.address = base_url.rstrip("/")
        headers = {"Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._control_timeout_s = control_timeout_s
        self._health_timeout_s = health_timeout_s
        self._http = HTTP1Client(self.address, headers=headers, max_connections=max_connections,
                                 connect_timeout_s=connect_timeout_s)
        self._background: set[asyncio.Task[None]] = set()

    # --- generation --------------------------------------------------------------------------

    async def _generate_json(self, path: str, payload: dict[str, Any], *, timeout_s: float,
                             request_id: str, prompt_key: str) -> tuple[dict[str, Any], float]:
        """POST a generation request (``payload[prompt_key]`` holds the prompt ids); returns the
        parsed answer and the seconds it took."""
        body = _encode(payload, prompt_key)
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout_s):
                status, raw = await self._http.request("POST", path, body)
        except TimeoutError as e:  # before OSError: TimeoutError is one
            self._abort_in_background(request_id)
            raise InferenceTimeout(f"{self.address} gave no whole answer to request {request_id} within "
                                   f"{timeout_s:.1f}s; the request was aborted there. Raise the "
                                   "turn deadline (timeout_s) if the server is just slow.") from e
        except OSError as e:
            raise InferenceError(f"{self.address}: {path} failed ({type(e).__name__}: {e}); "
                                 "the server may be down or restarting") from e
        except asyncio.CancelledError:
            self._abort_in_background(request_id)
            raise
        http_s = time.perf_counter() - started
        self._check_status(status, raw, path)
        return self._parse(raw, path), http_s

    def _parse(self, raw: bytes, path: str) -> dict[str, Any]:
        try:
            obj = loads_answer(raw)
        except ValueError as e:
            tail = raw[-80:].decode("utf-8", "replace")
            raise InferenceProtocolError(f"{self.address}: the answer of {path} is not valid JSON "
                                         f"({len(raw)} bytes, truncated? ends with {tail!r}): {e}") from e
        if not isinstance(obj, dict):
            raise InferenceProtocolError(f"{self.address}: the answer of {path} is not a JSON object")
        return obj

    def _check_status(self, status: int, raw: bytes, path: str) -> None:
        if status == 200:
            return
        detail = _error_message(raw)
        if status in (401, 403):
            raise InferenceRejected(f"{self.address} refused our credentials on {path} (HTTP {status}: "
                                    f"{detail}); pass the server's --api-key as the backend's api_key")
        if status == 404:
            raise InferenceProtocolError(f"{self.address} has no route {path} (HTTP 404); "
                                         f"{self._missing_route_hint(path)}")
        if status == 400 and _CONTEXT_LENGTH.search(detail):
            raise ContextLengthExceeded(f"{self.address} refused a prompt that does not fit its context window "
                                        f"on {path}: {detail}")
        if 400 <= status < 500 and status not in _RETRYABLE_4XX:
            raise InferenceRejected(f"{self.address} rejected the request to {path} (HTTP {status}): {detail}")
        raise InferenceError(f"{self.address} failed on {path} with HTTP {status}: {detail}")

    def _missing_route_hint(self, path: str) -> str:
        return "check that the address points at the right kind of server"

    def _abort_in_background(self, request_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._abort_quietly(request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort_quietly(self, request_id: str) -> None:
        try:
            await self.abort(request_id)
        except (InferenceError, OSError) as e:
            # Closing the connection already makes vLLM and SGLang drop the request.
            logger.debug("abort of %s on %s failed: %s", request_id, self.address, e)

    # --- control -----------------------------------------------------------------------------

    async def _control(self, method: str, path: str, payload: dict[str, Any] | None = None,
                       params: dict[str, str] | None = None) -> dict[str, Any]:
        target = f"{path}?{urlencode(params)}" if params else path
        body = json.dumps(payload).encode() if payload is not None else b""
        try:
            async with asyncio.timeout(self._control_timeout_s):
                status, raw = await self._http.request(method, target, body)
        except TimeoutError as e:
            raise InferenceTimeout(f"{self.address} did not answer {method} {path} within "
                                   f"{self._control_timeout_s}s (control_timeout_s)") from e
        except OSError as e:
            raise InferenceError(f"{self.address}: {method} {path} failed ({type(e).__name__}: {e})") from e
        self._check_status(status, raw, path)
        return self._parse(raw, path) if raw.strip() else {}

    async def health(self) -> bool:
        return await self.probe() == "ok"

    async def probe(self) -> str:
        """``slow`` when ``/health`` gives no answer within ``health_timeout_s``: a server busy
        generating answers late, and that alone must not take it out of the pool."""
        try:
            async with asyncio.timeout(self._health_timeout_s):
                status, _ = await self._http.request("GET", "/health")
        except TimeoutError:
            return "slow"
        except OSError:
            return "down"
        return "ok" if status == 200 else "down"

    async def close(self) -> None:
        if self._background:
            await asyncio.wait(set(self._background), timeout=self._control_timeout_s)
        self._http.close()

    @abstractmethod
    async def abort(self, request_id: str) -> None: ...


def prompt_list(prompt_ids: Sequence[int] | np.ndarray) -> list[int]:
    """Prompt ids as a list for the JSON body. A list is passed as it is (copying a long prompt
    on every turn would dominate the client's cost; a :class:`GrowingIds` brings its JSON text);
    a list holding numpy integers is converted when encoding fails (see :func:`_encode`)."""
    if isinstance(prompt_ids, list):
        return prompt_ids
    if isinstance(prompt_ids, np.ndarray):
        return prompt_ids.tolist()
    return [int(t) for t in prompt_ids]


def _encode(payload: dict[str, Any], prompt_key: str | None) -> bytes:
    ids = payload.get(prompt_key) if prompt_key is not None else None
    if isinstance(ids, GrowingIds):
        # The rest of the body is a few fields; the ids' text was made as they were appended.
        rest = json.dumps({k: v for k, v in payload.items() if k != prompt_key})
        return f"{rest[:-1]}{', ' if len(rest) > 2 else ''}{json.dumps(prompt_key)}: {ids.json()}}}".encode()
    try:
        return json.dumps(payload).encode()
    except TypeError:
        if prompt_key is None:
            raise
        payload[prompt_key] = [int(t) for t in payload[prompt_key]]
        return json.dumps(payload).encode()


def loads_answer(raw: bytes) -> Any:
    """``json.loads``, about three times faster on a generate answer, whose per-token
    log-probability entries are most of its bytes and of a turn's decoding CPU (real vLLM answers
    in ``bench/inference_overhead.py``). orjson refuses what Python's json reads (NaN and Infinity,
    integers past 64 bits): those answers get json's reading, and the checks after it then name
    what is wrong with them."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


def _error_message(raw: bytes) -> str:
    try:
        obj = json.loads(raw)
    except ValueError:
        return raw[:300].decode("utf-8", "replace") or "(empty body)"
    if isinstance(obj, dict):
        err = obj.get("error")
        for candidate in (obj.get("message"), err.get("message") if isinstance(err, dict) else err,
                          obj.get("detail")):
            if candidate:
                return str(candidate)[:500]
    return str(obj)[:300]
