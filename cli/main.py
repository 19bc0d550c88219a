"""``rolloutd`` console script: one subcommand per component, each implemented in its own module."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from rolloutd.native_io.errors import RolloutdError

if TYPE_CHECKING:
    from rolloutd.daemon.node.config import NodeConfig


def _cmd_demo(args: argparse.Namespace) -> int:
    from rolloutd.cli.demo import run_demo

    return run_demo(args)


def _cmd_image_build(args: argparse.Namespace) -> int:
    from rolloutd.daemon.sandbox.images import build_default_image

    print(asyncio.run(build_default_image(want_sif=args.sif)))
    return 0


def _node_config(args: argparse.Namespace) -> "NodeConfig":
    from rolloutd.daemon.node.config import NodeConfig, load_config

    if getattr(args, "config_from_env", False):
        import os

        # Popped: nothing this daemon starts (workers get it again, sandboxes never) inherits it,
        # and it may hold the inference key.
        return NodeConfig.from_json(os.environ.pop("ROLLOUTD_NODE_CONFIG_JSON"))
    overrides = {
        "run_dir": args.run_dir, "workers": args.workers, "backend": args.backend, "image": args.image,
        "warm_sandboxes_per_worker": args.warm, "router": args.router, "tcp_bind": args.tcp_bind,
        "inference_servers": args.inference_server, "log_level": args.log_level,
        "node_name": args.node_name, "router_public_key_file": args.router_public_key_file,
        "router_slots": args.router_slots, "curve_secret_key_file": args.curve_secret_key_file,
        "curve_allowed_keys_dir": args.curve_allowed_keys_dir, "content_special_tokens": args.content_special_tokens,
        "inference_api_key_file": args.inference_api_key_file,
        "debug_ops": args.debug_ops or None,
    }
    return load_config(args.config, {k: v for k, v in overrides.items() if v is not None})


def _cmd_node(args: argparse.Namespace) -> int:
    from rolloutd.cli import node

    config = _node_config(args)
    if args.node_command == "drain":
        return node.drain(config, resume=args.resume, wait_s=args.wait_s)
    if args.node_command == "check":
        print(f"node settings accepted: backend {config.backend}, {config.worker_count} workers, "
              f"{len(config.inference_servers)} inference servers")
        return 0
    return _lifecycle(node, config, args, args.node_command)


def _lifecycle(module: Any, config: Any, args: argparse.Namespace, command: str) -> int:
    """start/stop/status of a daemon whose ``module`` is ``node`` or ``router``."""
    pidfile = module.pidfile_path(config, args.pidfile)
    if command == "start":
        if args.detach:
            return module.start_detached(config, pidfile, args.log_file, args.ready_timeout_s)
        logging.getLogger().setLevel(config.log_level)
        return module.run_foreground(config, pidfile)
    if command == "stop":
        return module.stop(config, pidfile, args.timeout_s)
    return module.status(config, args.json)


def _add_node_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    from pathlib import Path

    node_p = sub.add_parser("node", help="the per-node daemon: start, stop, status, drain; check (the settings only)")
    node_sub = node_p.add_subparsers(dest="node_command", required=True)
    for name in ("start", "stop", "status", "drain", "check"):
        p = node_sub.add_parser(name)
        p.add_argument("--config", help="TOML file (also $ROLLOUTD_CONFIG)")
        p.add_argument("--run-dir", help="run folder (default $XDG_RUNTIME_DIR/rolloutd or /tmp/rolloutd-$UID)")
        p.add_argument("--pidfile", help="default <run folder>/node.pid")
        p.set_defaults(func=_cmd_node, workers=None, backend=None, image=None, warm=None, router=None,
                       tcp_bind=None, inference_server=None, log_level=None, node_name=None,
                       router_public_key_file=None, router_slots=None, curve_secret_key_file=None,
                       curve_allowed_keys_dir=None, content_special_tokens=None,
                       inference_api_key_file=None, debug_ops=False)
        if name == "start":
            p.add_argument("--detach", action="store_true",
                           help="run in the background (new session, output to the log file); return once it answers")
            p.add_argument("--log-file", type=Path, help="with --detach; default <run folder>/node.log")
            p.add_argument("--ready-timeout-s", type=float, default=300.0)
            p.add_argument("--config-from-env", action="store_true", help=argparse.SUPPRESS)
        if name in ("start", "check"):
            p.add_argument("--workers", type=int, help="worker processes (default: one per core)")
            p.add_argument("--backend", choices=["auto", "apptainer", "local"])
            p.add_argument("--image", help="image of the warm sandboxes")
            p.add_argument("--warm", type=int, help="warm sandboxes per worker")
            p.add_argument("--router", help="join this router (ipc://PATH or tcp://HOST:PORT) as a rollout node")
            p.add_argument("--router-public-key-file", help="the router's .key file (a tcp router)")
            p.add_argument("--router-slots", type=int, help="requests the router may run here at once")
            p.add_argument("--node-name", help="name at the router (default host:run folder)")
            p.add_argument("--curve-secret-key-file", help="this node's .key_secret file (rolloutd keygen)")
            p.add_argument("--curve-allowed-keys-dir", help="public keys of trainers allowed on --tcp-bind")
            p.add_argument("--tcp-bind", help="also listen on tcp://HOST:PORT (CURVE keys required)")
            p.add_argument("--inference-server", action="append", help="inference server URL (repeatable)")
            p.add_argument("--content-special-tokens", choices=["text", "reject", "special"],
                           help="added tokens' text in tool output and other non-model text (default text)")
            p.add_argument("--inference-api-key-file", help="file (mode 0600) holding the inference servers' bearer token")
            p.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
            p.add_argument("--debug-ops", action="store_true",
                           help="answer debug.* operations (tests, benchmarks); refused otherwise")
        elif name == "stop":
            p.add_argument("--timeout-s", type=float, default=20.0, help="graceful budget before SIGKILL")
        elif name == "drain":
            p.add_argument("--resume", action="store_true", help="take new work again (re-join)")
            p.add_argument("--wait-s", type=float, default=0.0,
                           help="then wait up to this long for the node's requests and sandboxes to finish")
        elif name == "status":
            p.add_argument("--json", action="store_true")


def _cmd_router(args: argparse.Namespace) -> int:
    import os

    from rolloutd.cli import router
    from rolloutd.daemon.router.config import RouterConfig, load_router_config

    if getattr(args, "config_from_env", False):
        config = RouterConfig.from_json(os.environ[router.CONFIG_ENV])
    else:
        names = ("run_dir", "tcp_bind", "node_bind", "curve_secret_key_file", "client_keys_dir", "node_keys_dir",
                 "heartbeat_interval_s", "heartbeat_timeout_s", "log_level")
        config = load_router_config(args.config, {k: getattr(args, k, None) for k in names})
    return _lifecycle(router, config, args, args.router_command)


def _add_router_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    from pathlib import Path

    router_p = sub.add_parser("router", help="the broker in front of many node daemons: start, stop, status")
    router_sub = router_p.add_subparsers(dest="router_command", required=True)
    for name in ("start", "stop", "status"):
        p = router_sub.add_parser(name)
        p.add_argument("--config", help="TOML file (also $ROLLOUTD_ROUTER_CONFIG)")
        p.add_argument("--run-dir", help="run folder (default that of `rolloutd node`)")
        p.add_argument("--pidfile", help="default <run folder>/router.pid")
        p.set_defaults(func=_cmd_router)
        if name == "start":
            p.add_argument("--detach", action="store_true",
                           help="run in the background (new session, output to the log file); return once it answers")
            p.add_argument("--log-file", type=Path, help="with --detach; default <run folder>/router.log")
            p.add_argument("--ready-timeout-s", type=float, default=60.0)
            p.add_argument("--tcp-bind", help="also accept trainers on tcp://HOST:PORT (CURVE keys required)")
            p.add_argument("--node-bind", help="where nodes connect: ipc://PATH or tcp://HOST:PORT (default ipc)")
            p.add_argument("--curve-secret-key-file", help="the router's .key_secret file (rolloutd keygen)")
            p.add_argument("--client-keys-dir", help="folder of trainers' .key files allowed on --tcp-bind")
            p.add_argument("--node-keys-dir", help="folder of nodes' .key files allowed on a tcp --node-bind")
            p.add_argument("--heartbeat-interval-s", type=float)
            p.add_argument("--heartbeat-timeout-s", type=float, help="drop a node silent this long")
            p.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
            p.add_argument("--config-from-env", action="store_true", help=argparse.SUPPRESS)
        elif name == "stop":
            p.add_argument("--timeout-s", type=float, default=20.0, help="graceful budget before SIGKILL")
        else:
            p.add_argument("--json", action="store_true")


def _cmd_keygen(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rolloutd.native_io.curve import keygen

    public, secret = keygen(Path(args.dir), args.name)
    print(f"public key {public}  (give it to the peers: their allowed-keys folder, or their server key)")
    print(f"secret key {secret}  (mode 0600; keep it on this machine)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rolloutd", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("policy-server", help="the reference CPU policy over vLLM/SGLang HTTP routes (see --help)")
    sub.add_parser("gateway", help="the published rollout server's HTTP API in front of a node (see --help)")

    _add_node_parser(sub)
    _add_router_parser(sub)

    keys = sub.add_parser("keygen", help="make a CURVE key pair (NAME.key public, NAME.key_secret secret)")
    keys.add_argument("name", help="file name stem, e.g. the host or trainer name")
    keys.add_argument("--dir", default=".", help="folder to write to (created 0700)")
    keys.set_defaults(func=_cmd_keygen)

    demo = sub.add_parser("demo", help="the main job: a demo batch on the bundled tasks")
    demo.add_argument("--backend", choices=["auto", "apptainer", "local"], default="auto")
    demo.add_argument("--n", type=int, default=2, help="samples per task")
    demo.add_argument("--tasks", type=int, default=0, help="only the first N bundled tasks (0 = all)")
    demo.add_argument("--warm", type=int, default=4, help="warm sandboxes per worker")
    demo.add_argument("--out", help="output folder (default out/demo-<time>)")
    demo.add_argument("--timeout-s", type=float, default=1800.0)
    policy = demo.add_mutually_exclusive_group()
    policy.add_argument("--inference-server", help="use this inference server (e.g. a vLLM URL) instead of the "
                                                   "scripted reference policy")
    policy.add_argument("--vllm", action="store_true", help="start real vLLM on the CPU (scripts/install-vllm) "
                                                            "with the tiny random-weight model")
    demo.add_argument("--max-tokens", type=int, default=1024, help="sampling max_tokens per model turn")
    demo.add_argument("--max-turns", type=int, default=0, help="agent max_turns (0 = the agent's default)")
    demo.set_defaults(func=_cmd_demo)

    image = sub.add_parser("image", help="sandbox images")
    image_sub = image.add_subparsers(dest="image_command", required=True)
    build = image_sub.add_parser("build", help="build (once) the default image and print its path")
    build.add_argument("--sif", action="store_true", help="also build a SIF file")
    build.set_defaults(func=_cmd_image_build)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["policy-server"]:
        # Its own parser owns every flag, --help included.
        from rolloutd.daemon.policy.server import main as policy_main

        return policy_main(argv[1:])
    if argv[:1] == ["gateway"]:
        from rolloutd.daemon.gateway.server import main as gateway_main

        return gateway_main(argv[1:])
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except RolloutdError as e:
        print(f"rolloutd: error [{e.code}]: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
