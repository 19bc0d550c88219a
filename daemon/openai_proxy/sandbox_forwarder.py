"""Runs INSIDE the sandbox (standard library only): gives a harness an HTTP URL for the proxy.

    python3 sandbox_forwarder.py --socket /run/rolloutd/openai/api.sock -- CMD [ARG...]

Listens on 127.0.0.1 (a free port), relays every connection byte for byte to the proxy's Unix
socket, and runs CMD with ``OPENAI_BASE_URL=http://127.0.0.1:<port>/v1`` and
``ANTHROPIC_BASE_URL=http://127.0.0.1:<port>`` (the Anthropic SDK adds ``/v1`` itself) in its environment.
Exits with CMD's exit status once CMD ends; SIGTERM or SIGINT is passed on to CMD. The
sandbox's own loopback is used, so this works with ``--network none``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys

CHUNK = 256 * 1024


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            data = await reader.read(CHUNK)
            if not data:
                break
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        pass


async def _relay(socket_path: str, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
    try:
        proxy_r, proxy_w = await asyncio.open_unix_connection(socket_path)
    except OSError as e:
        print(f"rolloutd forwarder: cannot reach the proxy at {socket_path}: {e}", file=sys.stderr)
        client_w.close()
        return
    try:
        await asyncio.gather(_pipe(client_r, proxy_w), _pipe(proxy_r, client_w))
    finally:
        for w in (proxy_w, client_w):
            w.close()


async def main(socket_path: str, argv: list[str]) -> int:
    server = await asyncio.start_server(lambda r, w: _relay(socket_path, r, w), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    env = dict(os.environ, OPENAI_BASE_URL=f"http://127.0.0.1:{port}/v1", ANTHROPIC_BASE_URL=f"http://127.0.0.1:{port}")
    child = await asyncio.create_subprocess_exec(*argv, env=env)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda s=sig: child.returncode is None and child.send_signal(s))
    try:
        return await child.wait()
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 1.0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    rc = asyncio.run(main(args.socket, command))
    sys.exit(rc if rc >= 0 else 128 - rc)
