"""The reference CPU policy server (``rolloutd policy-server``).

Serves the reference model over real HTTP with vLLM's and/or SGLang's wire protocol, so the
whole rollout pipeline and its log-probability check run on a laptop or in CI::

    python -m rolloutd.daemon.policy.server --api-key KEY [--port 0] [--protocol both]
        [--scripted PLANS.json] [--weights W.npz] [--seed 0] [--slots N --ms-per-token T]

It binds 127.0.0.1 unless told otherwise, requires ``Authorization: Bearer KEY`` on every route
but ``/health`` (the key comes from ``--api-key`` or ``ROLLOUTD_POLICY_API_KEY``), prints exactly
one line ``READY http://HOST:PORT`` on stdout once it serves, and stops on SIGTERM or SIGINT.
Besides the vLLM and SGLang routes it serves ``/update_weights_from_disk`` (SGLang's, taking a
reference-model ``.npz``) and ``/update_weight_version`` whatever the protocol, and
``GET /rolloutd/utilisation`` / ``POST /rolloutd/utilisation/reset`` for the slot simulation.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from rolloutd.daemon.policy import routes_sglang, routes_vllm
from rolloutd.daemon.policy.engine import PolicyEngine
from rolloutd.daemon.policy.model import ReferenceModel, default_model
from rolloutd.daemon.policy.scripted import ScriptedPlans, ScriptedReplies
from rolloutd.daemon.policy.state import STATE, PolicyState, error_middleware, read_json
from rolloutd.daemon.policy.tokenizer import DEFAULT_TOKENIZER_DIR, load_raw_tokenizer, special_ids
from rolloutd.native_io.errors import BadRequest, ConfigError

logger = logging.getLogger(__name__)

API_KEY_ENV = "ROLLOUTD_POLICY_API_KEY"
PROTOCOLS = ("vllm", "sglang", "both")
MODEL_NAME = "rolloutd-reference"


@dataclass
class PolicyServerConfig:
    api_key: str
    host: str = "127.0.0.1"
    port: int = 0
    """0 picks a free port."""
    protocol: str = "both"
    scripted: Path | ScriptedPlans | None = None
    weights: Path | None = None
    """An ``.npz`` saved by ReferenceModel.save; default: the model drawn from seed 0."""
    seed: int = 0
    """Seeds the sampling of requests that carry no seed of their own."""
    slots: int | None = None
    ms_per_token: float = 0.0
    weight_version: str = "0"
    tokenizer_dir: Path = DEFAULT_TOKENIZER_DIR

    def __post_init__(self) -> None:
        if not self.api_key:
            raise ConfigError(f"the policy server needs an API key: pass --api-key or set {API_KEY_ENV}")
        if self.protocol not in PROTOCOLS:
            raise ConfigError(f"protocol must be one of {PROTOCOLS}, got {self.protocol!r}")
        if self.ms_per_token < 0:
            raise ConfigError(f"ms_per_token must be >= 0, got {self.ms_per_token}")


@dataclass
class PolicyServerHandle:
    url: str
    engine: PolicyEngine
    state: PolicyState


def _auth_middleware(api_key: str) -> Callable[..., Any]:
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def middleware(request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        if request.path != "/health":
            given = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(given, expected):
                return web.json_response({"object": "error", "message": "missing or wrong API key",
                                          "type": "Unauthorized", "code": 401}, status=401)
        return await handler(request)

    return middleware


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def _update_weights_from_disk(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_json(request)
    path = body.get("model_path")
    if not isinstance(path, str):
        raise BadRequest("send model_path: an .npz of reference-model weights (or a folder holding weights.npz)")
    file = Path(path) / "weights.npz" if Path(path).is_dir() else Path(path)
    try:
        model = await asyncio.to_thread(ReferenceModel.load, file)
        if body.get("abort_all_requests"):
            state.engine.abort(None)
        version = body.get("weight_version")
        state.engine.load_model(model, None if version is None else str(version))
    except (ConfigError, BadRequest) as e:
        return web.json_response({"success": False, "message": str(e)}, status=400)
    logger.info("loaded weights from %s (weight version %s)", file, state.engine.weight_version)
    return web.json_response({"success": True, "message": f"loaded {file}", "num_paused_requests": 0})


async def _update_weight_version(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_json(request)
    if body.get("new_version") is None:
        raise BadRequest('send {"new_version": "<version>"}')
    if body.get("abort_all_requests"):
        state.engine.abort(None)
    state.engine.weight_version = str(body["new_version"])
    return web.json_response({"success": True, "message": f"weight version {state.engine.weight_version}"})


async def _utilisation(request: web.Request) -> web.Response:
    value, window = request.app[STATE].engine.utilisation()
    return web.json_response({"utilisation": value, "window_s": window})


async def _reset_utilisation(request: web.Request) -> web.Response:
    request.app[STATE].engine.reset_utilisation()
    return web.json_response({"utilisation": 0.0, "window_s": 0.0})


def build_app(config: PolicyServerConfig) -> tuple[web.Application, PolicyState]:
    tokenizer = load_raw_tokenizer(config.tokenizer_dir)
    special = special_ids(tokenizer)
    model = ReferenceModel.load(config.weights) if config.weights else default_model()
    if model.config.vocab_size != tokenizer.get_vocab_size():
        raise ConfigError(f"the weights have vocab {model.config.vocab_size} but the tokenizer in "
                          f"{config.tokenizer_dir} has {tokenizer.get_vocab_size()}")
    plans = config.scripted
    if isinstance(plans, Path):
        plans = ScriptedPlans.load(plans)
    engine = PolicyEngine(model, stop_ids=special.stop, slots=config.slots, ms_per_token=config.ms_per_token,
                          weight_version=config.weight_version, seed=config.seed)
    state = PolicyState(
        engine=engine, tokenizer=tokenizer, tokenizer_dir=config.tokenizer_dir, special=special,
        scripted=ScriptedReplies(plans, tokenizer, special) if plans is not None else None,
        model_name=MODEL_NAME + ("-scripted" if plans is not None else ""), created=int(time.time()))
    app = web.Application(middlewares=[_auth_middleware(config.api_key), error_middleware],
                          client_max_size=64 * 1024 * 1024)
    app[STATE] = state
    app.router.add_get("/health", _health)
    app.router.add_get("/v1/models", routes_vllm.models)
    app.router.add_post("/update_weights_from_disk", _update_weights_from_disk)
    app.router.add_post("/update_weight_version", _update_weight_version)
    app.router.add_get("/rolloutd/utilisation", _utilisation)
    app.router.add_post("/rolloutd/utilisation/reset", _reset_utilisation)
    if config.protocol in ("vllm", "both"):
        routes_vllm.add_routes(app)
    if config.protocol in ("sglang", "both"):
        routes_sglang.add_routes(app)
    return app, state


@contextlib.asynccontextmanager
async def serve_policy(config: PolicyServerConfig) -> AsyncIterator[PolicyServerHandle]:
    """Run the server in this event loop: ``async with serve_policy(cfg) as srv: srv.url``."""
    app, state = build_app(config)
    if state.scripted is not None:
        logger.warning("SCRIPTED mode: replies follow per-task plans, not the model's samples "
                       "(log-probabilities are still the model's)")
    # handler_cancellation: a client that hangs up aborts its request, as on vLLM and SGLang.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await state.engine.start()
    try:
        await site.start()
        port = runner.addresses[0][1]
        host = f"[{config.host}]" if ":" in config.host else config.host
        yield PolicyServerHandle(url=f"http://{host}:{port}", engine=state.engine, state=state)
    finally:
        await state.engine.stop()
        await runner.cleanup()


async def _serve_until_signal(config: PolicyServerConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with serve_policy(config) as handle:
        print(f"READY {handle.url}", flush=True)
        logger.info("serving %s (%s protocol) at %s", handle.state.model_name, config.protocol, handle.url)
        await stop.wait()
        logger.info("stopping")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rolloutd policy-server", description="Reference CPU policy server "
                                "speaking vLLM's and SGLang's token-in/token-out HTTP protocols.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port (printed in the READY line)")
    p.add_argument("--api-key", default=None, help=f"bearer token clients must send (or set {API_KEY_ENV})")
    p.add_argument("--protocol", choices=PROTOCOLS, default="both")
    p.add_argument("--scripted", type=Path, default=None, help='plans JSON: {"plans": {"<task id>": ["reply", ...]}}')
    p.add_argument("--weights", type=Path, default=None, help=".npz of reference-model weights")
    p.add_argument("--seed", type=int, default=0, help="seed for requests that carry none")
    p.add_argument("--slots", type=int, default=None, help="simulate a server that decodes at most N sequences at once")
    p.add_argument("--ms-per-token", type=float, default=0.0, help="simulated duration of one decode step (ms)")
    p.add_argument("--weight-version", default="0")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = PolicyServerConfig(
            api_key=args.api_key or os.environ.get(API_KEY_ENV, ""), host=args.host, port=args.port,
            protocol=args.protocol, scripted=args.scripted, weights=args.weights, seed=args.seed,
            slots=args.slots, ms_per_token=args.ms_per_token, weight_version=args.weight_version)
        try:
            import uvloop
            loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
        except ImportError:
            loop_factory = None
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(_serve_until_signal(config))
    except (ConfigError, OSError) as e:
        logger.error("%s", e)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
