"""The router's view of its nodes and the choice of a node for a request (pure, no sockets).

Capacity is counted by the router itself, at dispatch, so it is exact between heartbeats: a node
is *used* by its requests in flight (each costs its number of samples; ops on an open sandbox
cost nothing more) plus its open sandboxes, against the ``slots`` it reported. A request goes to
a node where it fits; if none has room it waits at the router (first come, first served) until
an answer frees a slot. Among the nodes where it fits:
1. the node that already took this task instance (same ``instance_id``: image, checkout and
   set-up reuse, the n samples of a task together),
2. else nodes that keep the request's image warm,
3. the least loaded (used / slots), ties to the node given the fewest requests so far.
A request too large for any node runs alone on an idle one rather than never.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from rolloutd.native_io.errors import BadRequest
from rolloutd.native_io.wire import PINNED_OPS, NodeCapacity


@dataclass(frozen=True)
class Hints:
    """What dispatch needs from a request, read without knowing the op's full schema."""

    cost: int = 1
    """Slots it takes: its number of samples; 0 for an op on an open sandbox."""
    affinity: str | None = None
    """Requests with the same key go to the same node while it has room (the task instance)."""
    image: str | None = None
    sandbox: str | None = None
    """For ops pinned to a sandbox: its id (the request must go to the node that has it)."""


PLAIN = Hints()
"""One slot, no preference: most requests."""


def routing_hints(op: Any, args: Any) -> Hints:
    """Hints for ``op``; lenient on purpose: the node checks the args against the op's schema,
    and the router need not know every op a node has (the rollout pipeline registers its own)."""
    if not isinstance(args, dict):
        return PLAIN
    if op in PINNED_OPS:
        sandbox = args.get("sandbox_id")
        if not isinstance(sandbox, str) or not sandbox:
            raise BadRequest(f"{op} needs args.sandbox_id (a string): the id sandbox.open returned")
        return Hints(cost=0, sandbox=sandbox)
    if op == "sandbox.open":
        image = args.get("image", "default")
        return Hints(image=image if isinstance(image, str) else None)
    task = args.get("task")
    if task is None and "n" not in args:
        return PLAIN
    task = task if isinstance(task, dict) else {}
    inline = task.get("inline")
    inline = inline if isinstance(inline, dict) else {}
    n = args.get("n", 1)
    instance = task.get("instance_id") or inline.get("instance_id")
    image = inline.get("image")
    return Hints(
        cost=n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1,
        affinity=f"{task.get('dataset', '')}/{instance}" if isinstance(instance, (str, int)) and instance != ""
        and not isinstance(instance, bool) else None,
        image=image if isinstance(image, str) else None,
    )


@dataclass(eq=False)
class NodeEntry:
    """One registered node as the router sees it."""

    identity: bytes
    """Routing id of its link: ``name/incarnation``."""
    name: str
    host: str
    pid: int
    capacity: NodeCapacity
    draining: bool = False
    last_seen: float = field(default_factory=time.monotonic)
    joined_at: float = field(default_factory=time.monotonic)
    in_flight: dict[str, int] = field(default_factory=dict)
    """Request id -> its cost, for the requests this node has and has not answered."""
    cost_in_flight: int = 0
    sandboxes: set[str] = field(default_factory=set)
    dispatched: int = 0
    answered: int = 0
    setup_applied: int = 0
    """Inference set-up ops (weight version, servers) replayed to it when it joined, and applied."""
    proof: str = ""
    """What proves it holds its name: its CURVE key (TCP) or the token issued to it (ipc)."""

    @property
    def slots(self) -> int:
        return self.capacity.slots

    @property
    def used(self) -> int:
        return self.cost_in_flight + len(self.sandboxes)

    @property
    def accepting(self) -> bool:
        return not self.draining and self.slots > 0

    def load(self) -> float:
        return self.used / self.slots if self.slots else float("inf")

    def fits(self, cost: int) -> bool:
        return self.accepting and (self.used + cost <= self.slots or self.used == 0)

    def take(self, rid: str, cost: int) -> None:
        self.in_flight[rid] = cost
        self.cost_in_flight += cost
        self.dispatched += 1

    def finish(self, rid: str) -> None:
        cost = self.in_flight.pop(rid, None)
        if cost is not None:
            self.cost_in_flight -= cost
            self.answered += 1

    def status(self, now: float) -> dict[str, Any]:
        return {
            "name": self.name, "identity": self.identity.decode(errors="replace"), "host": self.host,
            "pid": self.pid, "state": "draining" if self.draining else ("ready" if self.slots else "starting"),
            "slots": self.slots, "used": self.used, "load": round(self.load(), 3) if self.slots else None,
            "in_flight": len(self.in_flight), "sandboxes": len(self.sandboxes),
            "heartbeat_age_s": round(now - self.last_seen, 3), "up_s": round(now - self.joined_at, 1),
            "dispatched": self.dispatched, "answered": self.answered, "setup_applied": self.setup_applied,
            "reported": {"workers_ready": self.capacity.workers_ready, "in_flight": self.capacity.in_flight,
                         "free": self.capacity.free, "images": self.capacity.images},
        }


def pick_node(nodes: Iterable[NodeEntry], hints: Hints, preferred: NodeEntry | None = None) -> NodeEntry | None:
    """The node for a request (see the module docstring), or None when it must wait.

    One pass, no allocation per node: this runs for every request the router dispatches.
    """
    cost, image = hints.cost, hints.image
    best: NodeEntry | None = None
    best_key: tuple[int, float, int] | None = None
    for n in nodes:
        slots = n.capacity.slots
        if n.draining or not slots:
            continue
        used = n.cost_in_flight + len(n.sandboxes)
        if used + cost > slots and used:
            continue
        if n is preferred:
            return n
        key = (0 if image is None or image in n.capacity.images else 1, used / slots, n.dispatched)
        if best_key is None or key < best_key:
            best, best_key = n, key
    return best
