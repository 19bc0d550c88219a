"""``rolloutd gateway``: the published rollout server's HTTP API in front of a node daemon or router.

::

    rolloutd gateway [--token-file TOKEN] [--bind 127.0.0.1:8006] [--address ipc://...|tcp://...]
                     [--timeout-s 300] [--process-wait-s S] [--dataset NAME=/abs/file.jsonl]...
                     [--inference-server URL]... [--start] [--allow-remote] [--trusted-network CIDR]...
                     [--mode prorl|native]

Callers authenticate with the token (``Authorization: Bearer <token>``, or the token in the URL,
``http://rolloutd:<token>@HOST:PORT``) unless they call from a ``--trusted-network`` (see
:mod:`.auth`); 401 otherwise. The gateway binds a loopback address unless ``--allow-remote`` or a
trusted network says otherwise. It prints one line ``READY http://HOST:PORT`` once it serves and
stops on SIGTERM or SIGINT within :data:`STOP_WITHIN_S`. Errors answer ``{"detail": ..., "code":
...}`` with the published server's statuses: 503 when not started or no inference server is
registered (also when the node is busy or unreachable), 504 when a job outlives its wait (it is
cancelled), 400 for an unknown data source or bad values, 422 for a body that is not the route's
JSON object (``detail`` then lists the faults as FastAPI does; 400 in ``--mode native``), 413 for
a body over 64 MiB and 408 for one that does not arrive.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import uvloop
from aiohttp import web

from rolloutd.client.async_client import default_address
from rolloutd.native_io.errors import (
    BadRequest,
    Busy,
    ConfigError,
    DaemonUnavailable,
    InferenceError,
    InvalidBody,
    MessageTooLarge,
    NoInferenceServer,
    NotFound,
    OperationTimeout,
    RolloutdError,
    ShuttingDown,
    TaskError,
)

from ..policy.tokenizer import load_tokenizer
from .auth import DEFAULT_BIND, TOKEN_ENV, Access, Listen, parse_networks, read_token
from .body import CANCEL, LLM_SERVER, MAX_BODY_BYTES, PROCESS, PROCESS_NATIVE, read_body
from .mapping import DataSources
from .service import Gateway, GatewayConfig

log = logging.getLogger(__name__)

STOP_WITHIN_S = 5.0
"""How long SIGTERM may take: pending jobs are cancelled and answered, then the server closes."""
GATEWAY: web.AppKey[Gateway] = web.AppKey("gateway", Gateway)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def http_status(e: RolloutdError, *, prorl: bool) -> int:
    if isinstance(e.details.get("http_status"), int):
        return int(e.details["http_status"])  # type: ignore[arg-type]
    if isinstance(e, InvalidBody):
        return 422 if prorl else 400
    if isinstance(e, MessageTooLarge):
        return 413
    if isinstance(e, OperationTimeout):
        return 504
    if isinstance(e, (NoInferenceServer, Busy, DaemonUnavailable, ShuttingDown)):
        return 503
    if isinstance(e, (BadRequest, ConfigError, TaskError)):
        return 400
    if isinstance(e, NotFound):
        return 404
    if isinstance(e, InferenceError):
        return 502
    return 500


def _error(status: int, code: str, detail: Any) -> web.Response:
    return web.json_response({"detail": detail, "code": code}, status=status)


def _middlewares(access: Access, *, prorl: bool) -> list[Any]:
    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        refusal = access.refusal(request.headers.get("Authorization", ""), request.remote)
        if refusal is not None:
            response = _error(401, "UNAUTHORIZED", refusal)
            response.headers["WWW-Authenticate"] = 'Bearer, Basic realm="rolloutd gateway"'
            return response
        return await handler(request)

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except RolloutdError as e:
            status = http_status(e, prorl=prorl)
            if status >= 500:
                log.warning("%s %s -> %d %s: %s", request.method, request.path, status, e.code, e)
            if status == 422:
                return _error(status, e.code, e.details.get("errors", str(e)))
            return _error(status, e.code, str(e))

    return [auth, errors]


def _running(handler: Handler) -> Handler:
    """Routes that need a started gateway answer 503 before, as the published server does."""
    async def wrapped(request: web.Request) -> web.StreamResponse:
        if not request.app[GATEWAY].running:
            return _error(503, "NOT_RUNNING", "the gateway is not running: POST /start first")
        return await handler(request)

    return wrapped


async def _start(request: web.Request) -> web.Response:
    return web.json_response(await request.app[GATEWAY].start())


async def _stop(request: web.Request) -> web.Response:
    return web.json_response(await request.app[GATEWAY].stop())


async def _status(request: web.Request) -> web.Response:
    return web.json_response(await request.app[GATEWAY].status())


async def _add_llm_server(request: web.Request) -> web.Response:
    body = await read_body(request, LLM_SERVER)
    return web.json_response(await request.app[GATEWAY].add_server(body["address"]))


async def _clear_llm_server(request: web.Request) -> web.Response:
    return web.json_response(await request.app[GATEWAY].clear_servers())


async def _process(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    body = await read_body(request, PROCESS if gateway.config.prorl else PROCESS_NATIVE)
    result = await gateway.process(body["instance"], body.get("sampling_params"), body.get("job_id"))
    return web.json_response(result)


async def _cancel(request: web.Request) -> web.Response:
    body = await read_body(request, CANCEL)
    return web.json_response(await request.app[GATEWAY].cancel(body["job_id"]))


def build_app(gateway: Gateway, access: Access) -> web.Application:
    app = web.Application(middlewares=_middlewares(access, prorl=gateway.config.prorl), client_max_size=MAX_BODY_BYTES)
    app[GATEWAY] = gateway
    app.router.add_post("/start", _start)
    app.router.add_post("/stop", _running(_stop))
    app.router.add_get("/status", _running(_status))
    app.router.add_post("/add_llm_server", _add_llm_server)
    app.router.add_post("/clear_llm_server", _clear_llm_server)
    app.router.add_post("/process", _running(_process))
    app.router.add_post("/cancel", _running(_cancel))
    return app


@contextlib.asynccontextmanager
async def serve_gateway(config: GatewayConfig, listen: Listen, access: Access) -> AsyncIterator[tuple[str, Gateway]]:
    """Serve in this event loop: ``async with serve_gateway(cfg, listen, access) as (url, gw)``."""
    gateway = Gateway(config)
    runner = web.AppRunner(build_app(gateway, access), access_log=None, shutdown_timeout=STOP_WITHIN_S / 2)
    await runner.setup()
    try:
        site = web.TCPSite(runner, listen.host, listen.port)
        await site.start()
        port = runner.addresses[0][1]
        host = f"[{listen.host}]" if ":" in listen.host else listen.host
        yield f"http://{host}:{port}", gateway
    finally:
        # Pending jobs end first (503), so the HTTP side has nothing left to wait for; their
        # cancelled answers are not awaited past the stop budget (closing the client frees them).
        if gateway.running:
            await gateway.stop(within_s=STOP_WITHIN_S / 4)
        await runner.cleanup()
        await gateway.close(drain_s=STOP_WITHIN_S / 4)


async def _serve_until_signal(config: GatewayConfig, listen: Listen, access: Access, *, start: bool,
                              servers: list[str]) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with serve_gateway(config, listen, access) as (url, gateway):
        for spec in servers:
            await gateway.add_server(spec)
        if start:
            await gateway.start()
        print(f"READY {url}", flush=True)
        log.info("gateway at %s forwarding to %s (%s; trusted networks: %s)", url, config.address,
                 "running" if gateway.running else "waiting for POST /start",
                 ", ".join(map(str, access.trusted)) or "none")
        await stop.wait()
        log.info("stopping")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rolloutd gateway", description="The published rollout server's HTTP API "
                                "(/process, /cancel, /status, /add_llm_server, /clear_llm_server, /start, /stop) "
                                "in front of a rolloutd node daemon or router.")
    p.add_argument("--bind", default=DEFAULT_BIND, help=f"HOST:PORT to listen on (default {DEFAULT_BIND})")
    p.add_argument("--allow-remote", action="store_true",
                   help="allow a --bind address that is not loopback (callers then send the token)")
    p.add_argument("--trusted-network", action="append", default=[], metavar="CIDR",
                   help="callers from this network need no token (repeatable; also allows a non-loopback --bind)")
    p.add_argument("--token-file", type=Path, help=f"file holding the token, mode 600 (or set ${TOKEN_ENV})")
    p.add_argument("--address", help="node daemon or router (default: $ROLLOUTD_ADDRESS or this user's node)")
    p.add_argument("--mode", choices=("prorl", "native"), default="prorl",
                   help="prorl (default): the published server's request and answer shapes; native: rolloutd's")
    p.add_argument("--tokenizer", help="the node's tokenizer folder (its --tokenizer; 'reference' for the bundled "
                   "one): the text of each message in the answer (empty without it)")
    p.add_argument("--timeout-s", type=float, default=300.0,
                   help="stage time a job may use, queue waits excluded (the published server's --timeout)")
    p.add_argument("--process-wait-s", type=float, default=None,
                   help="how long /process waits before 504 and cancel (default 2 x timeout + 10)")
    p.add_argument("--dataset", action="append", default=[], metavar="NAME=PATH",
                   help="accept data_source NAME for the JSONL dataset PATH on the node (repeatable)")
    p.add_argument("--inference-server", action="append", default=[], metavar="URL",
                   help="as POST /add_llm_server before the first /start (repeatable)")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--start", action="store_true", help="accept jobs at once, as after POST /start")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.timeout_s <= 0 or (args.process_wait_s is not None and args.process_wait_s <= 0):
            raise ConfigError("--timeout-s and --process-wait-s must be > 0")
        tokenizer = None
        if args.tokenizer:
            tokenizer = load_tokenizer(None if args.tokenizer == "reference" else args.tokenizer)
        config = GatewayConfig(address=args.address or default_address(), timeout_s=args.timeout_s,
                               process_wait_s=args.process_wait_s, sources=DataSources.parse(args.dataset),
                               prorl=args.mode == "prorl", tokenizer=tokenizer)
        trusted = parse_networks(args.trusted_network)
        listen = Listen.parse(args.bind, allow_remote=args.allow_remote or bool(trusted))
        access = Access(read_token(args.token_file), trusted)
        uvloop.run(_serve_until_signal(config, listen, access, start=args.start, servers=args.inference_server))
    except (RolloutdError, OSError) as e:
        log.error("%s", e)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
