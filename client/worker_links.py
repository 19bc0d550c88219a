"""A leased sandbox's commands straight to the worker that holds it, for a client on the node.

The node's answer to ``sandbox.open`` names that worker's socket (``link``) when the client is on
the node; the commands of the sandbox (``wire.DIRECT_OPS``) go there, one Unix-socket message each
way, instead of through the supervisor and ZeroMQ (``daemon/node/client_links.py``). One link per
worker, shared by the sandboxes it holds. A link that closes with commands pending means the
worker died (or the node stopped): they fail with WORKER_LOST, as they would through the node.
A link that cannot be made (its worker restarted since the lease) is not used: the command goes
to the node, which answers SANDBOX_LOST.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from typing import Any

from rolloutd.native_io.errors import WorkerLost
from rolloutd.native_io.unix_link import UnixLink

log = logging.getLogger(__name__)


class WorkerLinks:
    def __init__(self, on_message: Callable[[list[Any]], None],
                 on_lost: Callable[[str, WorkerLost], None]) -> None:
        """``on_message``: every answer that comes on a link; ``on_lost(id, error)``: a request
        pending on a link that closed."""
        self._on_message = on_message
        self._on_lost = on_lost
        self._links: dict[str, UnixLink] = {}
        self._pending: dict[str, str] = {}
        """Request id -> the path of the link it was sent on, until its answer is taken."""

    async def send(self, path: str, rid: str, frames: list[Any]) -> bool:
        """Send a request on the link at ``path``; False (nothing sent) when there is no link."""
        if self.send_now(path, rid, frames) is not None:
            return True
        return await self._connect(path) is not None and self.send_now(path, rid, frames) is not None

    def send_now(self, path: str, rid: str, frames: list[Any]) -> UnixLink | None:
        """Send a request on the link at ``path`` if it is open (no connecting, so no event loop
        needed); the link it went on, or None when nothing was sent."""
        link = self._links.get(path)
        if link is None or link.closed:
            return None
        link.send(frames)  # raises only on a closed link, ruled out above
        if link.closed:  # the send failed and closed it: nothing went
            return None
        self._pending[rid] = path
        return link

    def cancel(self, rid: str, frames: list[Any]) -> bool:
        """Send a CANCEL on the link ``rid`` went on; False when it did not go on one."""
        link = self._links.get(self._pending.get(rid, ""))
        if link is None:
            return False
        if not link.closed:
            link.send(frames)
        return True

    def done(self, rid: str) -> None:
        self._pending.pop(rid, None)

    async def _connect(self, path: str) -> UnixLink | None:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, path)
        except OSError as e:
            log.debug("no link to the worker at %s (%s): commands go through the node", path, e)
            sock.close()
            return None
        link = UnixLink(sock, self._on_message, on_close=lambda: self._closed(path), loop=loop)
        self._links[path] = link
        return link

    def _closed(self, path: str) -> None:
        self._links.pop(path, None)
        for rid in [rid for rid, p in self._pending.items() if p == path]:
            del self._pending[rid]
            self._on_lost(rid, WorkerLost(
                f"the worker holding this sandbox died (or the node stopped) while request {rid} ran there "
                "(its link closed); the command may have had effects, so it was not retried"))

    def close(self) -> None:
        for link in list(self._links.values()):
            link.on_close = None
            link.close()
        self._links.clear()
        self._pending.clear()
