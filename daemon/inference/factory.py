"""Build a backend from a spec string, detecting what an HTTP server speaks when not told.

Specs:
- ``vllm+http://HOST:PORT``: vLLM; ``/inference/v1/generate`` if the server has it, else ``/v1/completions``
- ``vllm-generate+http://...`` / ``vllm-completions+http://...``: vLLM with that route, no probing
- ``sglang+http://HOST:PORT``: SGLang ``/generate``
- ``http://HOST:PORT``: probe: vLLM generate route, then SGLang (``GET /get_model_info``), then vLLM
  completions (``GET /v1/models``)
- ``vllm-inprocess:/path/to/model``: vLLM engine in this process (needs ``rolloutd[vllm]``); on a
  node the supervisor runs one such engine for all workers and gives them the next form instead
- ``vllm-engine+ipc:///path/engine.sock``: the node's shared engine host

Probing sends no generation: an empty JSON body to ``/inference/v1/generate`` is answered 400/422
by a server that has the route and 404 by one that does not.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

import aiohttp

from rolloutd.daemon.inference.base import InferenceBackend
from rolloutd.daemon.inference.engine_client import SPEC_PREFIX, EngineClientBackend
from rolloutd.daemon.inference.sglang_http import SGLangHTTPBackend
from rolloutd.daemon.inference.vllm_http import GENERATE_PATH, VLLMHTTPBackend
from rolloutd.native_io.errors import ConfigError, InferenceError, InferenceProtocolError, InferenceRejected

logger = logging.getLogger(__name__)

_HTTP_SPEC = re.compile(r"^(?:(vllm|vllm-generate|vllm-completions|sglang)\+)?(https?://[^\s]+)$")
SPEC_FORMS = ("vllm+http://HOST:PORT", "vllm-generate+http://...", "vllm-completions+http://...",
              "sglang+http://HOST:PORT", "http://HOST:PORT (detect)", "vllm-inprocess:/path/to/model")


def parse_spec(spec: str) -> tuple[str, str]:
    """``(kind, target)`` with kind one of vllm, vllm-generate, vllm-completions, sglang, auto,
    vllm-inprocess."""
    if spec.startswith("vllm-inprocess:"):
        model = spec.removeprefix("vllm-inprocess:")
        if not model:
            raise ConfigError("vllm-inprocess: needs a model path or name, e.g. vllm-inprocess:/models/qwen")
        return "vllm-inprocess", model
    match = _HTTP_SPEC.match(spec.strip())
    if match is None:
        raise ConfigError(f"cannot read inference server spec {spec!r}; use one of {', '.join(SPEC_FORMS)}")
    return match.group(1) or "auto", match.group(2).rstrip("/")


async def make_backend(spec: str, *, api_key: str | None = None, detect_timeout_s: float = 10.0,
                       **http_options: Any) -> InferenceBackend:
    """A backend for ``spec``; ``http_options`` go to the HTTP backend (timeouts, max_connections)."""
    if spec.startswith(SPEC_PREFIX):
        engine = EngineClientBackend(spec.removeprefix(SPEC_PREFIX))
        try:
            await engine.discover()
        except BaseException:
            await engine.close()
            raise
        return engine
    kind, target = parse_spec(spec)
    if kind == "vllm-inprocess":
        from rolloutd.daemon.inference.vllm_inprocess import VLLMInProcessBackend

        return VLLMInProcessBackend.from_model(target)
    if kind in ("vllm", "auto"):
        kind = await detect_protocol(target, api_key=api_key, timeout_s=detect_timeout_s,
                                     vllm_only=kind == "vllm")
    if kind == "sglang":
        return SGLangHTTPBackend(target, api_key=api_key, **http_options)
    backend = VLLMHTTPBackend(target, route=kind.removeprefix("vllm-"), api_key=api_key, **http_options)
    try:
        await backend.discover()
    except InferenceRejected:
        await backend.close()
        raise
    except InferenceError as e:
        # A server without /v1/models still generates; agents then budget by their own config.
        logger.warning("%s does not report its context window (%s); agents use their max_context_tokens", target, e)
    return backend


async def detect_protocol(url: str, *, api_key: str | None = None, timeout_s: float = 10.0,
                          vllm_only: bool = False) -> str:
    """``vllm-generate``, ``vllm-completions`` or ``sglang`` for the server at ``url``."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with asyncio.timeout(timeout_s), aiohttp.ClientSession(headers=headers) as session:
            status = await _probe(session, "POST", url + GENERATE_PATH, json={})
            if status not in (404, 405):
                return "vllm-generate"
            if vllm_only:
                return "vllm-completions"
            if await _probe(session, "GET", url + "/get_model_info") == 200:
                return "sglang"
            if await _probe(session, "GET", url + "/v1/models") == 200:
                return "vllm-completions"
    except aiohttp.ClientError as e:
        raise InferenceError(f"cannot reach inference server {url} ({type(e).__name__}: {e}); "
                             "is it running, and is the address right?") from e
    except TimeoutError as e:
        raise InferenceError(f"inference server {url} did not answer the protocol probes within "
                             f"{timeout_s}s (detect_timeout_s)") from e
    raise InferenceProtocolError(f"{url} serves neither {GENERATE_PATH}, /get_model_info nor /v1/models; "
                                 "name the protocol in the spec, e.g. sglang+http://... or vllm+http://...")


async def _probe(session: aiohttp.ClientSession, method: str, url: str, **kwargs: Any) -> int:
    async with session.request(method, url, **kwargs) as resp:
        await resp.read()
        if resp.status in (401, 403):
            raise InferenceRejected(f"{url} refused our credentials (HTTP {resp.status}); pass the "
                                    "server's --api-key as api_key")
        if resp.status >= 500:
            raise InferenceError(f"{url} failed with HTTP {resp.status} while probing its protocol")
        return resp.status
