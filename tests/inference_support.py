"""Shared pieces of the inference tests: the reference server started in-process, a server that
answers wrongly on purpose, and the trainer-side log-probability check."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
from aiohttp import web

from support.waits import async_wait_until
from rolloutd.daemon.inference.base import GenerateResult
from rolloutd.daemon.policy.model import default_model
from rolloutd.daemon.policy.server import PolicyServerConfig, PolicyServerHandle, serve_policy

API_KEY = "test-key-123"
NAN = float("nan")
PROMPT = [1, 464, 207, 918, 971, 34, 276, 74, 75, 207, 2, 207, 1, 580, 207]

BAD_MODES = ("ok", "http500", "truncated", "no_logprobs", "short_logprobs", "hang", "disconnect",
             "unauthorized", "bad_request", "too_many", "wrong_token", "nan_logprob")


@contextlib.asynccontextmanager
async def policy_server(**options: Any) -> AsyncIterator[PolicyServerHandle]:
    async with serve_policy(PolicyServerConfig(api_key=API_KEY, **options)) as handle:
        yield handle


def max_logprob_error(prompt: list[int], result: GenerateResult) -> float:
    """Trainer-side check: recompute each generated token's log-probability from the ids alone
    with the reference model and return the largest absolute difference to the backend's."""
    recomputed = default_model().token_logprobs(prompt, result.token_ids)
    if recomputed.size == 0:
        return 0.0
    return float(np.abs(recomputed - result.logprobs).max())


WAIT_S = 10.0
"""How long the inference tests wait for a server-side state (a request running, an abort)."""


async def wait_until(predicate: Any, timeout_s: float = WAIT_S, what: str = "condition") -> None:
    await async_wait_until(predicate, timeout_s, what)


class BadServer:
    """An aiohttp server on 127.0.0.1 whose generation routes misbehave as ``mode`` says; it
    records the aborts it receives."""

    def __init__(self, mode: str = "ok", *, completions_only: bool = False) -> None:
        """``completions_only``: serve only vLLM's /v1/completions and /v1/models, like a vLLM
        that predates /inference/v1/generate."""
        assert mode in BAD_MODES
        self.mode = mode
        self.completions_only = completions_only
        self.aborted: list[str] = []
        self.generate_calls = 0
        self.hanging = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def __aenter__(self) -> BadServer:
        app = web.Application()
        app.router.add_post("/v1/completions", self._vllm_completions)
        app.router.add_get("/v1/models", self._models)
        if not self.completions_only:
            app.router.add_post("/inference/v1/generate", self._vllm_generate)
            app.router.add_post("/generate", self._sglang_generate)
        app.router.add_post("/abort_requests", self._abort_vllm)
        app.router.add_post("/inference/v1/abort_requests", self._abort_vllm)
        app.router.add_post("/abort_request", self._abort_sglang)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._runner is not None
        await self._runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "m", "object": "model"}]})

    async def _abort_vllm(self, request: web.Request) -> web.Response:
        # Recorded without vLLM's per-route prefix, so tests compare the ids they chose.
        self.aborted.extend(i.removeprefix("generate-tokens-").removeprefix("cmpl-")
                            for i in (await request.json())["request_ids"])
        return web.json_response({"status": "aborted", "aborted": 1})

    async def _abort_sglang(self, request: web.Request) -> web.Response:
        self.aborted.append((await request.json())["rid"])
        return web.json_response({"success": True, "message": ""})

    async def _misbehave(self, request: web.Request, good: dict[str, Any],
                         without_logprobs: dict[str, Any], short: dict[str, Any],
                         too_many: dict[str, Any], wrong_token: dict[str, Any],
                         nan_logprob: dict[str, Any]) -> web.StreamResponse:
        body = await request.json()
        if not any(key in body for key in ("token_ids", "prompt", "input_ids")):
            # What vLLM's and SGLang's request validation answer (and what protocol probes send).
            return web.json_response({"object": "error", "message": "field required"}, status=400)
        self.generate_calls += 1
        if self.mode == "http500":
            return web.json_response({"object": "error", "message": "CUDA error: device-side assert"}, status=500)
        if self.mode == "unauthorized":
            return web.json_response({"error": "Unauthorized"}, status=401)
        if self.mode == "bad_request":
            return web.json_response({"object": "error", "message": "max_tokens is too large"}, status=400)
        if self.mode == "hang":
            self.hanging += 1
            try:
                await asyncio.sleep(3600)
            finally:
                self.hanging -= 1
        if self.mode == "truncated":
            text = json.dumps(good)
            return web.Response(body=text[: len(text) // 2].encode(), content_type="application/json")
        if self.mode == "disconnect":
            resp = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": "1000"})
            await resp.prepare(request)
            await resp.write(json.dumps(good).encode()[:20])
            assert request.transport is not None
            request.transport.close()
            return resp
        answers = {"ok": good, "no_logprobs": without_logprobs, "short_logprobs": short,
                   "too_many": too_many, "wrong_token": wrong_token, "nan_logprob": nan_logprob}
        return web.json_response(answers[self.mode])  # json.dumps: a NaN goes out as the bare word NaN

    async def _vllm_generate(self, request: web.Request) -> web.StreamResponse:
        def answer(ids: list[int], lps: list[float] | None, names: list[int] | None = None) -> dict[str, Any]:
            content = None if lps is None else [
                {"token": f"token_id:{t}", "logprob": lp, "top_logprobs": []} for t, lp in zip(names or ids, lps)]
            return {"request_id": "generate-tokens-x", "choices": [{
                "index": 0, "finish_reason": "stop", "token_ids": ids,
                "logprobs": None if content is None else {"content": content}}]}
        return await self._misbehave(
            request, answer([5, 6, 2], [-1.0, -2.0, -0.5]), answer([5, 6, 2], None),
            answer([5, 6, 2], [-1.0, -2.0]), answer(list(range(3, 103)), [-1.0] * 100),
            answer([5, 6, 2], [-1.0, -2.0, -0.5], names=[5, 7, 2]), answer([5, 6, 2], [-1.0, NAN, -0.5]))

    async def _vllm_completions(self, request: web.Request) -> web.StreamResponse:
        def answer(ids: list[int], lps: list[float] | None) -> dict[str, Any]:
            logprobs = None if lps is None else {"tokens": [str(t) for t in ids], "token_logprobs": lps,
                                                 "top_logprobs": [], "text_offset": []}
            return {"id": "cmpl-x", "object": "text_completion", "choices": [{
                "index": 0, "text": "", "finish_reason": "stop", "token_ids": ids, "logprobs": logprobs}]}
        return await self._misbehave(
            request, answer([5, 6, 2], [-1.0, -2.0, -0.5]), answer([5, 6, 2], None),
            answer([5, 6, 2], [-1.0, -2.0]), answer(list(range(3, 103)), [-1.0] * 100),
            answer([5, 6, 2], [-1.0, None, -0.5]), answer([5, 6, 2], [-1.0, NAN, -0.5]))  # type: ignore[list-item]

    async def _sglang_generate(self, request: web.Request) -> web.StreamResponse:
        def answer(ids: list[int], lps: list[float] | None, output_ids: list[int] | None = None) -> dict[str, Any]:
            meta: dict[str, Any] = {"id": "x", "finish_reason": {"type": "stop", "matched": 2},
                                    "weight_version": "7", "prompt_tokens": 3, "completion_tokens": len(ids)}
            if lps is not None:
                meta["output_token_logprobs"] = [[lp, t, None] for t, lp in zip(ids, lps)]
            return {"text": "", "output_ids": output_ids or ids, "meta_info": meta}
        return await self._misbehave(
            request, answer([5, 6, 2], [-1.0, -2.0, -0.5]), answer([5, 6, 2], None),
            answer([5, 6, 2], [-1.0, -2.0], output_ids=[5, 6, 2]), answer(list(range(3, 103)), [-1.0] * 100),
            answer([5, 6, 2], [-1.0, -2.0, -0.5], output_ids=[5, 7, 2]), answer([5, 6, 2], [-1.0, NAN, -0.5]))


@contextlib.asynccontextmanager
async def policy_server_process(*args: str) -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    """The reference server as a separate process (``python -m ...server``); yields it and its URL."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "rolloutd.daemon.policy.server", "--port", "0", "--api-key", API_KEY,
        "--log-level", "WARNING", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(30):
            line = (await proc.stdout.readline()).decode().strip()
        assert line.startswith("READY "), line
        yield proc, line.split()[1]
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
