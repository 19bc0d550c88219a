"""``rolloutd`` console script: one subcommand per component, each implemented in its own module."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from rolloutd.native_io.errors import RolloutdError

if TYPE_CHECKING:
    from .config import NodeConfig


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args)


def _cmd_image_build(args: argparse.Namespace) -> int:
    from .sandbox.images import build_default_image

    print(asyncio.run(build_default_image(want_sif=args.sif)))
    return 0


def _node_config(args: argparse.Namespace) -> "NodeConfig":
    from .config import NodeConfig, load_config

    if getattr(args, "config_from_env", False):
        import os

        return NodeConfig.from_json(os.environ["ROLLOUTD_NODE_CONFIG_JSON"])
    overrides = {
        "run_dir": args.run_dir, "workers": args.workers, "backend": args.backend, "image": args.image,
        "warm_sandboxes_per_worker": args.warm, "router": args.router, "tcp_bind": args.tcp_bind,
        "inference_servers": args.inference_server, "log_level": args.log_level,
    }
    return load_config(args.config, {k: v for k, v in overrides.items() if v is not None})


def _cmd_node(args: argparse.Namespace) -> int:
    from . import node

    config = _node_config(args)
    pidfile = node.pidfile_path(config, args.pidfile)
    if args.node_command == "start":
        if args.detach:
            return node.start_detached(config, pidfile, args.log_file, args.ready_timeout_s)
        logging.getLogger().setLevel(config.log_level)
        return node.run_foreground(config, pidfile)
    if args.node_command == "stop":
        return node.stop(config, pidfile, args.timeout_s)
    return node.status(config, args.json)


def _add_node_parser(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    from pathlib import Path

    node_p = sub.add_parser("node", help="the per-node daemon: start, stop, status")
    node_sub = node_p.add_subparsers(dest="node_command", required=True)
    for name in ("start", "stop", "status"):
        p = node_sub.add_parser(name)
        p.add_argument("--config", help="TOML file (also $ROLLOUTD_CONFIG)")
        p.add_argument("--run-dir", help="run folder (default $XDG_RUNTIME_DIR/rolloutd or /tmp/rolloutd-$UID)")
        p.add_argument("--pidfile", help="default <run folder>/node.pid")
        p.set_defaults(func=_cmd_node, workers=None, backend=None, image=None, warm=None, router=None,
                       tcp_bind=None, inference_server=None, log_level=None)
        if name == "start":
            p.add_argument("--detach", action="store_true",
                           help="run in the background (new session, output to the log file); return once it answers")
            p.add_argument("--log-file", type=Path, help="with --detach; default <run folder>/node.log")
            p.add_argument("--ready-timeout-s", type=float, default=300.0)
            p.add_argument("--workers", type=int, help="worker processes (default: one per core)")
            p.add_argument("--backend", choices=["auto", "apptainer", "local"])
            p.add_argument("--image", help="image of the warm sandboxes")
            p.add_argument("--warm", type=int, help="warm sandboxes per worker")
            p.add_argument("--router", help="join this router as a rollout node")
            p.add_argument("--tcp-bind", help="also listen on tcp://HOST:PORT (CURVE keys required)")
            p.add_argument("--inference-server", action="append", help="inference server URL (repeatable)")
            p.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
            p.add_argument("--config-from-env", action="store_true", help=argparse.SUPPRESS)
        elif name == "stop":
            p.add_argument("--timeout-s", type=float, default=20.0, help="graceful budget before SIGKILL")
        else:
            p.add_argument("--json", action="store_true")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rolloutd", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    sub.add_parser("policy-server", help="the reference CPU policy over vLLM/SGLang HTTP routes (see --help)")
    sub.add_parser("gateway", help="the published rollout server's HTTP API in front of a node (see --help)")

    _add_node_parser(sub)

    demo = sub.add_parser("demo", help="the main job: a demo batch on the bundled tasks")
    demo.add_argument("--backend", choices=["auto", "apptainer", "local"], default="auto")
    demo.add_argument("--n", type=int, default=2, help="samples per task")
    demo.add_argument("--tasks", type=int, default=0, help="only the first N bundled tasks (0 = all)")
    demo.add_argument("--warm", type=int, default=4, help="warm sandboxes per worker")
    demo.add_argument("--out", help="output folder (default out/demo-<time>)")
    demo.add_argument("--timeout-s", type=float, default=1800.0)
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
        from .policy.server import main as policy_main

        return policy_main(argv[1:])
    if argv[:1] == ["gateway"]:
        from .gateway.server import main as gateway_main

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
