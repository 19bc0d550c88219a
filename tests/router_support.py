"""A router with node daemons as separate processes, and a bare trainer that counts every answer."""

from __future__ import annotations

import collections
import contextlib
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import psutil
import zmq

from daemon_fixtures import CLI, router_daemon, start_nodes, stop_node
from rolloutd.client.async_client import RolloutRequest
from rolloutd.client.sync_client import RolloutClient
from rolloutd.daemon.node.config import NodeConfig
from rolloutd.daemon.node.sandbox_user import workers_dir
from rolloutd.native_io import framing
from rolloutd.native_io.wire import MsgType

NODE_ARGS = ("--backend", "local", "--workers", "1", "--warm", "1", "--router-slots", "2", "--debug-ops")
FAST_HEARTBEATS = ("--heartbeat-interval-s", "0.2", "--heartbeat-timeout-s", "1.0")
LOG_TAIL_CHARS = 6000
"""Of the router's log, printed when a test in a federation fails."""


@dataclass
class Federation:
    router_dir: Path
    address: str
    node_dirs: list[Path]
    node_args: tuple[str, ...]
    pids: dict[Path, list[int]] = field(default_factory=dict)
    """Every pid each node folder had (a restarted node has several)."""

    @property
    def nodes_address(self) -> str:
        return f"ipc://{self.router_dir}/nodes.sock"

    def node_pid(self, i: int) -> int:
        return int((self.node_dirs[i] / "node.pid").read_text())

    def start(self, indices: list[int]) -> None:
        dirs = [self.node_dirs[i] for i in indices]
        start_nodes(dirs, "--router", self.nodes_address, *self.node_args)
        for d in dirs:
            self.pids.setdefault(d, []).append(int((d / "node.pid").read_text()))

    def status(self) -> dict[str, Any]:
        with RolloutClient(self.address, timeout_s=10) as c:
            return c.status()

    def wait_nodes(self, n: int, timeout_s: float = 20.0) -> dict[str, Any]:
        """The router's status once exactly ``n`` nodes are registered and ready."""
        deadline = time.monotonic() + timeout_s
        while True:
            st = self.status()
            if len(st["nodes"]) == n and all(x["state"] == "ready" for x in st["nodes"]):
                return st
            assert time.monotonic() < deadline, f"wanted {n} ready nodes, router has {st['nodes']}"
            time.sleep(0.05)

    def node_of(self, run_dir: str) -> int:
        return [str(d) for d in self.node_dirs].index(run_dir)

    @property
    def sandbox_dirs(self) -> list[str]:
        """Where each node's sandboxes live on the host (outside the run folder under root)."""
        return [str(workers_dir(NodeConfig(run_dir=str(d)))) for d in self.node_dirs]


@contextlib.contextmanager
def federation(base: Path, n_nodes: int, *, router_args: tuple[str, ...] = FAST_HEARTBEATS,
               node_args: tuple[str, ...] = NODE_ARGS) -> Iterator[Federation]:
    """A router on ``base/router`` and ``n_nodes`` node daemons on ``base/n<i>``, all ready."""
    router_dir = base / "router"
    with router_daemon(router_dir, *router_args) as address:
        fed = Federation(router_dir, address, [base / f"n{i}" for i in range(n_nodes)], node_args)
        try:
            fed.start(list(range(n_nodes)))
            fed.wait_nodes(n_nodes)
            yield fed
        except BaseException:
            for log in [router_dir / "router.log", *(d / "node.log" for d in fed.node_dirs)]:
                with contextlib.suppress(OSError):
                    print(f"{log}, last lines:\n", log.read_text()[-LOG_TAIL_CHARS:])
            raise
        finally:
            for d in fed.node_dirs:
                if d in fed.pids:
                    # A node the test killed has nothing to stop; its leftovers are still checked.
                    stop_node(d, fed.pids[d], rung="sigterm" if psutil.pid_exists(fed.pids[d][-1]) else None)


class RawTrainer:
    """A bare DEALER that records every answer it gets: the client library would hide a duplicate."""

    def __init__(self, address: str, curve: Any = None, client: str | None = None) -> None:
        self.client = {"client": client} if client is not None else {}
        """The client identity it declares (the library sends one per client object)."""
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:
            curve.apply_client(self.sock)
        self.sock.connect(address)
        self.answers: dict[str, list[tuple[int, dict[str, Any], int]]] = {}
        """id -> every (type, header, number of array frames) that came for it."""

    def send(self, rid: str, op: str, args: dict[str, Any]) -> None:
        self.sock.send_multipart(framing.encode(MsgType.REQUEST, {"id": rid, "op": op, "args": args,
                                                                  "arrays": "frames", **self.client}))

    def cancel(self, rid: str) -> None:
        self.sock.send_multipart(framing.encode(MsgType.CANCEL, {"id": rid, **self.client}))

    def collect(self, ids: list[str], timeout_s: float, linger_s: float = 1.0) -> dict[str, list[Any]]:
        """Receive until every id has an answer, then ``linger_s`` more to catch any second one."""
        deadline = time.monotonic() + timeout_s
        done_at: float | None = None
        while True:
            now = time.monotonic()
            if done_at is None and all(i in self.answers for i in ids):
                done_at = now
            if done_at is not None and now - done_at > linger_s:
                return self.answers
            assert now < deadline, f"unanswered after {timeout_s} s: {[i for i in ids if i not in self.answers]}"
            if self.sock.poll(50):
                frames = self.sock.recv_multipart()
                header = msgpack.unpackb(frames[1], raw=False)
                self.answers.setdefault(header.get("id", ""), []).append((frames[0][0], header, len(frames) - 2))

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def counted_request(log: Path, rid: str, seconds: float) -> RolloutRequest:
    """A real rollout (script agent, inline command task) that appends ``rid`` to ``log`` once it
    ran to its end: a run cancelled in time leaves no line. Its answer carries trajectory arrays."""
    record = {"type": "command", "instance_id": rid, "eval_script": "echo 1"}
    commands = [f"sleep {seconds}", f"echo {rid} >> {log}"]
    return RolloutRequest(task=record, agent="script", agent_config={"commands": commands}, ipython=False,
                          request_id=rid)


def counted_rollout(log: Path, rid: str, seconds: float) -> dict[str, Any]:
    """:func:`counted_request`'s args, for a bare trainer."""
    return counted_request(log, rid, seconds).to_args()


def run_log(folder: Path) -> Path:
    """A log every sandbox user may append to (a root daemon runs sandboxes as another user)."""
    folder.chmod(0o755)
    log = folder / "runs.log"
    log.touch(mode=0o666)
    log.chmod(0o666)
    return log


def runs(log: Path) -> collections.Counter[str]:
    """Completed runs per request id."""
    return collections.Counter(log.read_text().split())


def keygen(folder: Path, name: str) -> tuple[Path, Path]:
    """``rolloutd keygen``: the (public, secret) key files of ``name``, the secret private."""
    out = subprocess.run([*CLI, "keygen", name, "--dir", str(folder)], capture_output=True, text=True, check=True)
    public, secret = folder / f"{name}.key", folder / f"{name}.key_secret"
    assert str(public) in out.stdout and (secret.stat().st_mode & 0o777) == 0o600
    return public, secret
