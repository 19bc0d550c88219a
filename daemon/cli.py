"""``rolloutd`` console script: one subcommand per component, each implemented in its own module."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable, Sequence

from rolloutd.native_io.errors import RolloutdError


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return asyncio.run(run_demo(args))


def _cmd_image_build(args: argparse.Namespace) -> int:
    from .sandbox.images import build_default_image

    print(asyncio.run(build_default_image(want_sif=args.sif)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rolloutd", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="the main job: a demo batch on the bundled tasks")
    demo.add_argument("--backend", choices=["auto", "apptainer", "local"], default="auto")
    demo.set_defaults(func=_cmd_demo)

    image = sub.add_parser("image", help="sandbox images")
    image_sub = image.add_subparsers(dest="image_command", required=True)
    build = image_sub.add_parser("build", help="build (once) the default image and print its path")
    build.add_argument("--sif", action="store_true", help="also build a SIF file")
    build.set_defaults(func=_cmd_image_build)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
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
