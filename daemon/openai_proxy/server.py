"""The per-rollout HTTP server: OpenAI's chat routes on a Unix socket in the sandbox's run folder.

Routes: ``POST /v1/chat/completions`` (JSON, or Server-Sent Events with ``stream: true``),
``POST /v1/messages`` (Anthropic's Messages API) and ``POST /v1/responses`` (OpenAI's Responses
API), both translated into a chat request of the same session (``apis.py``: one history, one
token ledger, their own reply, stream and error shapes), ``GET /v1/models``,
``GET /v1/models/{id}`` (any id: chat serves the one policy under any model name, so every name
is that model); ``POST /v1/completions`` is refused (404 naming the chat route: a text
completion has no chat history to keep). Every route needs ``Authorization: Bearer <key>`` (or
Anthropic's ``x-api-key: <key>``) with the rollout's own key. The socket sits in the lease's run
folder, which the sandbox sees at ``/run/rolloutd``; nothing listens on TCP (a harness that needs
a URL gets one from the loopback forwarder started inside the sandbox, ``sandbox_forwarder.py``).

A streamed reply is written once the whole turn is generated (the inference pool returns whole
turns): the role, the content in pieces, each tool call, the finish reason, the usage when
``stream_options.include_usage`` is set, then ``data: [DONE]``.

Errors use OpenAI's shape ``{"error": {"message", "type", "param", "code"}}`` (Anthropic's
``{"type": "error", "error": {...}}`` on ``/v1/messages``), the HTTP layer's too: 400 for
requests refused (the SDK does not retry them), 401 for a wrong key, 404 for an unknown route,
405 for a wrong method, 413 for a body over ``max_body_bytes``, 502 when the inference servers
failed (the SDK retries; the history is unchanged), 503 once the rollout is over.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from rolloutd.native_io.errors import BadRequest, ConfigError, InferenceError, InferenceRejected

from .apis import APIS, CHAT, Api, api_of
from .protocol import model_body, models_body
from .session import ProxySession

log = logging.getLogger(__name__)

MAX_SOCKET_PATH = 107
MAX_BODY_BYTES = 64 * 1024 * 1024
CLOSE_TIMEOUT_S = 5.0
PARSE_ON_LOOP_BYTES = 64 * 1024


class OpenAIProxyServer:
    """Serves one :class:`ProxySession` on ``socket_path`` until :meth:`close`."""

    def __init__(self, session: ProxySession, *, api_key: str, socket_path: Path,
                 max_body_bytes: int = MAX_BODY_BYTES) -> None:
        if not api_key:
            raise ConfigError("the OpenAI proxy needs an API key")
        if len(str(socket_path).encode()) > MAX_SOCKET_PATH:
            raise ConfigError(f"socket path {socket_path} is longer than the {MAX_SOCKET_PATH}-byte Unix-socket "
                              "limit; use a shorter sandbox state folder")
        self.session = session
        self.socket_path = socket_path
        self.max_body_bytes = max_body_bytes
        self._key = api_key.encode()
        self._created = int(time.time())
        self._runner: web.AppRunner | None = None
        self._in_flight: set[asyncio.Task[Any]] = set()
        self._closing = False

    async def start(self) -> None:
        app = web.Application(middlewares=[self._guard], client_max_size=self.max_body_bytes)
        for path, api in APIS.items():
            app.router.add_post(path, functools.partial(self._serve, api=api))
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model}", self._model)
        app.router.add_post("/v1/completions", self._completions)
        # A harness that disconnects mid-turn cancels the turn: it never saw the reply, so the
        # history must not hold it.
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=1.0)
        await runner.setup()
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        try:
            await web.UnixSite(runner, str(self.socket_path)).start()
        except BaseException:
            await runner.cleanup()
            raise
        # The sandbox runs as this user (or as root mapped onto it); the key is the access check.
        self.socket_path.chmod(0o600)
        self._runner = runner

    async def close(self) -> None:
        """Stop serving: requests in flight are cancelled (their turns are not recorded)."""
        self._closing = True
        for task in list(self._in_flight):
            task.cancel()
        if self._in_flight:
            await asyncio.wait(list(self._in_flight), timeout=CLOSE_TIMEOUT_S)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()

    @web.middleware
    async def _guard(self, request: web.Request, handler: Any) -> web.StreamResponse:
        api = api_of(request.path)
        if self._closing:
            return api.error(503, "the rollout is over; this proxy no longer serves requests", type_="server_error",
                          code="rolloutd_trajectory_ended")
        # Bearer for OpenAI's SDKs (and Anthropic's auth_token), x-api-key for Anthropic's api_key.
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            token = request.headers.get("x-api-key", "")
        if not hmac.compare_digest(token.strip().encode(), self._key):
            return api.error(401, "Incorrect API key provided: use the key in OPENAI_API_KEY of this rollout",
                             code="invalid_api_key")
        task = asyncio.current_task()
        assert task is not None
        self._in_flight.add(task)
        try:
            return await handler(request)
        except web.HTTPException as e:  # the router's 404/405, the body's 413: in OpenAI's shape too
            if e.status < 400:
                raise
            message = _HTTP_MESSAGES.get(e.status)
            return api.error(e.status, e.reason if message is None else message.format(
                path=request.path, method=request.method, limit=self.max_body_bytes), code=_HTTP_CODES.get(e.status))
        finally:
            self._in_flight.discard(task)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(models_body(self.session.model, self._created))

    async def _model(self, request: web.Request) -> web.Response:
        return web.json_response(model_body(request.match_info["model"], self._created))

    async def _completions(self, request: web.Request) -> web.Response:
        return CHAT.error(404, "/v1/completions (text completions) is not served: the proxy keeps the token history of "
                           "a chat; send the conversation to /v1/chat/completions", code="unsupported_endpoint")

    async def _serve(self, request: web.Request, api: Api) -> web.StreamResponse:
        """One model turn in ``api``'s shapes: every API's request becomes a chat request and is
        served by the one session (one history, one set of checks)."""
        raw = await request.read()
        try:
            # A big body parses in a worker thread: the GIL passes back to the loop every few ms.
            body = json.loads(raw) if len(raw) <= PARSE_ON_LOOP_BYTES else await asyncio.to_thread(json.loads, raw)
        except (ValueError, UnicodeDecodeError) as e:
            return api.error(400, f"the request body is not valid JSON: {e}")
        except RecursionError:
            return api.error(400, "the request body nests JSON too deeply")
        try:
            chat = api.parse(body, unapplied=self.session.unapplied_fields)
            completion = await self.session.complete(chat)
        except BadRequest as e:
            return api.error(400, str(e), code=_str(e.details.get("code")), param=_str(e.details.get("param")))
        except InferenceRejected as e:
            return api.error(400, f"the inference server refused the turn: {e}", code="inference_rejected")
        except InferenceError as e:
            return api.error(502, f"the inference servers failed this turn; retry it: {e}", type_="server_error",
                             code=e.code.lower())
        except ConfigError as e:
            return api.error(400, str(e))
        if not chat.stream:
            return web.json_response(api.body(completion))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        for frame in api.frames(completion, chat):
            await response.write(frame)
        await response.write_eof()
        return response


_HTTP_MESSAGES = {
    404: "{method} {path} is not a route of this proxy: it serves /v1/chat/completions, /v1/messages, "
         "/v1/responses and /v1/models",
    405: "{method} is not allowed on {path}",
    413: "the request body is over the proxy's {limit} bytes",
}
_HTTP_CODES = {404: "unknown_url", 405: "method_not_allowed", 413: "request_too_large"}


def _str(value: object) -> str | None:
    return None if value is None else str(value)
