"""A worker's backend for the node's shared vLLM engine (:mod:`rolloutd.daemon.inference.engine_host`).

Spec ``vllm-engine+ipc:///run/dir/engine-0.sock``; the supervisor writes it in place of each
``vllm-inprocess:MODEL`` it started an engine host for, so every worker uses the one engine.
Calls are matched to answers by id; an answer that is an error becomes the error of its wire
code (a timeout on the engine is InferenceTimeout, a refused prompt InferenceRejected...). A call
that times out here or is cancelled is aborted on the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import zmq
import zmq.asyncio

from rolloutd.daemon.inference.base import (
    PAUSE_MODES,
    GenerateResult,
    InferenceBackend,
    SamplingParams,
    checked_result,
)
from rolloutd.native_io.errors import (
    ConfigError,
    InferenceError,
    InferenceProtocolError,
    InferenceTimeout,
    RolloutdError,
    error_from_code,
)
from rolloutd.native_io.zmq_sockets import make_socket

logger = logging.getLogger(__name__)

SPEC_PREFIX = "vllm-engine+"


class EngineClientBackend(InferenceBackend):
    kind = "vllm-inprocess"

    def __init__(self, address: str, *, control_timeout_s: float = 60.0, health_timeout_s: float = 5.0) -> None:
        """``address`` is the engine host's ``ipc://`` socket."""
        if not address.startswith("ipc://"):
            raise ConfigError(f"the node engine's address must be ipc://PATH, got {address!r}")
        self.address = SPEC_PREFIX + address
        self._endpoint = address
        self._control_timeout_s = control_timeout_s
        self._health_timeout_s = health_timeout_s
        self._ctx = zmq.asyncio.Context()
        self._sock = make_socket(self._ctx, zmq.DEALER)
        self._sock.connect(address)
        self._ids = itertools.count()
        self._prefix = f"w{os.getpid()}-"
        self._waiting: dict[str, asyncio.Future[tuple[dict[str, Any], list[Any]]]] = {}
        self._reader: asyncio.Task[None] | None = None

    async def discover(self) -> None:
        header, _ = await self._call({"op": "info"}, timeout_s=self._control_timeout_s)
        limit = header.get("max_model_len")
        self.max_model_len = limit if isinstance(limit, int) and limit > 0 else None

    async def _read_answers(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            try:
                header = msgpack.unpackb(frames[0].bytes)
                waiter = self._waiting.pop(str(header["id"]), None)
            except (ValueError, KeyError, TypeError, msgpack.UnpackException) as e:
                logger.warning("the node engine sent an answer that cannot be read: %s", e)
                continue
            if waiter is not None and not waiter.done():
                waiter.set_result((header, frames[1:]))

    async def _call(self, request: dict[str, Any], *, timeout_s: float, buffers: Sequence[Any] = (),
                    rid: str | None = None) -> tuple[dict[str, Any], list[Any]]:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read_answers(), name="engine-answers")
        rid = rid or self._prefix + str(next(self._ids))
        waiter: asyncio.Future[tuple[dict[str, Any], list[Any]]] = asyncio.get_running_loop().create_future()
        self._waiting[rid] = waiter
        try:
            await self._sock.send_multipart([msgpack.packb({**request, "id": rid}), *buffers], copy=False)
            async with asyncio.timeout(timeout_s):
                header, frames = await waiter
        finally:
            self._waiting.pop(rid, None)
        if not header.get("ok"):
            raise error_from_code(str(header.get("code", "INFERENCE")),
                                  f"{self.address}: {header.get('message', 'the engine failed')}")
        return header, frames

    async def generate(self, prompt_ids: Sequence[int] | np.ndarray, params: SamplingParams, *,
                       request_id: str, timeout_s: float) -> GenerateResult:
        prompt = np.asarray(prompt_ids, dtype=np.int32)
        sampling = {"max_tokens": params.max_tokens, "temperature": params.temperature, "top_p": params.top_p,
                    "top_k": params.top_k, "seed": params.seed, "stop_token_ids": list(params.stop_token_ids),
                    "ignore_eos": params.ignore_eos, "extra": params.extra}
        started = time.perf_counter()
        try:
            # The engine's own deadline is the caller's; ours adds a margin for the answer's trip.
            header, frames = await self._call({"op": "generate", "sampling": sampling, "timeout_s": timeout_s},
                                              timeout_s=timeout_s + 5.0, buffers=[prompt.tobytes()], rid=request_id)
        except TimeoutError as e:
            if isinstance(e, InferenceTimeout):
                raise
            self._abort_soon(request_id)
            raise InferenceTimeout(f"{self.address} gave no answer to {request_id} within {timeout_s:.1f}s; "
                                   "it was aborted there. Raise the turn deadline (timeout_s).") from e
        except asyncio.CancelledError:
            self._abort_soon(request_id)
            raise
        if len(frames) != 2:
            raise InferenceProtocolError(f"{self.address} answered {request_id} with {len(frames)} array frames, not 2")
        ids = np.frombuffer(frames[0].buffer, dtype=np.int32).tolist()
        logprobs = np.frombuffer(frames[1].buffer, dtype=np.float32).tolist()
        spans = [{"version": v, "start": s, "end": e} for v, s, e in header.get("spans", [])]
        return checked_result(ids, logprobs, header.get("finish_reason"), params=params, server=self.address,
                              what="the node engine's answer", request_id=request_id,
                              http_s=time.perf_counter() - started, weight_spans=spans,
                              weight_version=str(header.get("weight_version") or ""))

    def _abort_soon(self, request_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._abort_quietly(request_id))
        task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)

    async def _abort_quietly(self, request_id: str) -> None:
        with contextlib.suppress(RolloutdError, TimeoutError, zmq.ZMQError):
            await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        await self._call({"op": "abort", "request_id": request_id}, timeout_s=self._control_timeout_s)

    async def health(self) -> bool:
        try:
            header, _ = await self._call({"op": "health"}, timeout_s=self._health_timeout_s)
        except (InferenceError, TimeoutError):
            return False
        return bool(header.get("healthy"))

    async def probe(self) -> str:
        try:
            header, _ = await self._call({"op": "health"}, timeout_s=self._health_timeout_s)
        except TimeoutError:
            return "slow"
        except InferenceError:
            return "down"
        return "ok" if header.get("healthy") else "down"

    async def pause(self, mode: str = "keep") -> None:
        if mode not in PAUSE_MODES:
            raise ConfigError(f"pause mode must be one of {sorted(PAUSE_MODES)}, got {mode!r}")
        await self._call({"op": "pause", "mode": mode}, timeout_s=self._control_timeout_s)

    async def resume(self) -> None:
        await self._call({"op": "resume"}, timeout_s=self._control_timeout_s)

    async def set_weight_version(self, version: str) -> None:
        await self._call({"op": "set_weight_version", "version": version}, timeout_s=self._control_timeout_s)

    async def update_weights(self, path: str, version: str | None = None) -> None:
        """Load the HF checkpoint folder ``path`` into the node's engine (see engine_host)."""
        await self._call({"op": "update_weights", "path": path, "version": version}, timeout_s=self._control_timeout_s)

    async def close(self) -> None:
        """Calls still waiting for an answer fail with InferenceError (their answers can no longer come)."""
        for rid, waiter in list(self._waiting.items()):
            if not waiter.done():
                waiter.set_exception(InferenceError(f"{self.address}: the backend was closed while {rid} "
                                                    "waited for its answer"))
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self._sock.close()
        self._ctx.term()
