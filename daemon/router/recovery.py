"""What a router knows of work its nodes did without it: answers they keep until acknowledged,
work a stalled node still runs, and what a router that restarted can collect.

Nodes keep each answer they sent through a router (arrays included) until the router
acknowledges it (``RouterAck``: sent once the answer reached its trainer), and list what they
keep and what they still run when they register. With that:
- a router killed and started again waits ``heartbeat_timeout_s`` before it dispatches anything
  (nodes register again within a heartbeat), and then sends a client's repeat of an id to the node
  that holds it: the node answers from what it kept, or the answer of the run under way comes;
- a node that stalled past the heartbeat timeout and comes back has cancelled on it what was
  re-dispatched elsewhere meanwhile, gets back what still waits for a node, and its answers are
  taken while the id is pending anywhere (then the other copy is cancelled).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rolloutd.daemon.common.request_book import RequestBook
from rolloutd.daemon.router.dispatch import NodeEntry
from rolloutd.daemon.router.requests import Pending
from rolloutd.native_io import framing
from rolloutd.native_io.wire import MsgType, RouterAck, node_message

log = logging.getLogger(__name__)

MARKER = "router.running"
"""In the router's run folder while it serves; found at start, it says the last router died."""
ACK_BATCH = 256
"""Acknowledgements to one node sent at once at most; more go out without waiting for the tick."""


class Recovery:
    def __init__(self, run_path: Path, grace_s: float, book: RequestBook[Pending], counters: dict[str, int],
                 send_raw: Callable[[bytes, bytes, list[Any]], bool]) -> None:
        self.book = book
        self.counters = counters
        self._send_raw = send_raw
        self._marker = run_path / MARKER
        self.restarted = self._marker.exists()
        self.hold_until = time.monotonic() + grace_s if self.restarted else 0.0
        self.held_by: dict[str, bytes] = {}
        """Ids a node holds (running, or answered and kept) that no client asked this router for yet."""
        self._acks: dict[bytes, list[str]] = {}

    def started(self) -> None:
        if self.restarted:
            log.warning("the last router on this folder did not stop cleanly: waiting for nodes to report what "
                        "they hold before dispatching")
        self._marker.touch(mode=0o600)

    def stopped(self) -> None:
        self._marker.unlink(missing_ok=True)

    @property
    def holding_back(self) -> bool:
        return time.monotonic() < self.hold_until

    # --- answers kept on nodes -------------------------------------------------------------------

    def ack(self, node_id: bytes, key: str) -> None:
        acks = self._acks.setdefault(node_id, [])
        acks.append(key)
        if len(acks) >= ACK_BATCH:
            self.send_acks()

    def send_acks(self) -> None:
        for node_id, keys in self._acks.items():
            self._send_raw(node_id, b"", node_message(RouterAck(keys)))
        self._acks.clear()

    def holder(self, key: str, nodes: Callable[[bytes], NodeEntry | None]) -> NodeEntry | None:
        """The registered node that holds ``key`` from before this router knew of it."""
        node_id = self.held_by.pop(key, None)
        return nodes(node_id) if node_id is not None else None

    def claim(self, key: str, node_id: bytes) -> bool:
        """Whether ``node_id`` held ``key`` (running it) before the client asked this router: its
        answer is the one."""
        if self.held_by.get(key) != node_id:
            return False
        del self.held_by[key]
        return True

    def unasked(self, node_id: bytes, key: str) -> None:
        """A node answered an id this router never took (it restarted): the node keeps the answer
        until the client asks again (then it goes to that node) or it expires there."""
        if self.book.answered(key):
            self.ack(node_id, key)
        else:
            self.held_by[key] = node_id

    def forget_node(self, node_id: bytes) -> None:
        for key in [k for k, n in self.held_by.items() if n == node_id]:
            del self.held_by[key]

    # --- a node registers ------------------------------------------------------------------------------

    def reconcile(self, node: NodeEntry, running: list[str], finished: list[str],
                  send_to: Callable[[Pending, NodeEntry], None]) -> None:
        """Square what ``node`` says it runs and keeps with this router's book."""
        for key in running:
            p = self.book.get(key)
            if p is None:
                if self.book.answered(key):
                    self.cancel_on(node.identity, key)  # answered elsewhere meanwhile
                else:
                    self.held_by[key] = node.identity
            elif p.node is None and p.broadcast is None and p.hints.sandbox is None:
                # Still waiting for a node: it may finish where it already runs.
                self.counters["resumed_on_return"] += 1
                send_to(p, node)
            elif p.node is not node:
                self.counters["cancelled_on_return"] += 1
                p.sent_to.discard(node.identity)
                p.withdrawn.add(node.identity)
                self.cancel_on(node.identity, key)
        for key in finished:
            p = self.book.get(key)
            if p is None:
                self.unasked(node.identity, key)
            elif p.node is None:
                send_to(p, node)  # the node answers from what it kept
            elif p.node is not node and node.identity in p.sent_to:
                # Its kept answer is taken (and the copy elsewhere cancelled) when it comes.
                self._send_raw(node.identity, key.encode(), p.frames)

    def cancel_on(self, node_id: bytes, key: str) -> None:
        self._send_raw(node_id, key.encode(), framing.encode(MsgType.CANCEL, {"id": key}))
