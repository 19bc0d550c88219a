"""The router keeps exactly-once under faults (issue 30): real router and node processes, a node
that shares another's name, clients that reuse or cancel each other's ids, a node that answers
what it was not asked, a node stalled past the heartbeat timeout, a router killed with SIGKILL
and started again, and a trainer that reconnects while its answer is on the way."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq

from daemon_fixtures import router_daemon, start_nodes, start_router, stop_node
from router_support import (FAST_HEARTBEATS, NODE_ARGS, Federation, RawTrainer, counted_request, counted_rollout,
                            federation, keygen, run_log, runs)
from support.net import free_port
from support.waits import wait_until
from rolloutd.client.async_client import AsyncRolloutClient
from rolloutd.daemon.router.dispatch import NodeEntry
from rolloutd.daemon.router.nodes import NodeTable
from rolloutd.native_io import framing
from rolloutd.native_io.errors import DaemonLost
from rolloutd.native_io.wire import MsgType, NodeCapacity, NodeRegister, node_message

REPLY, ERROR = MsgType.REPLY.value, MsgType.ERROR.value
JOIN_TIMEOUT_S = 20.0
"""A node started with a fast heartbeat registers (or is refused) well within this."""
LOST_BOUND_S = 30.0
"""A client whose router was killed has every pending call failed within this (no wait forever)."""


def _router_pid(router_dir: Path) -> int:
    return int((router_dir / "router.pid").read_text())


# --- node identity --------------------------------------------------------------------------------


def test_name_claim_rule_on_the_table() -> None:
    """The rule itself: a live holder's name goes only to a peer with the holder's proof."""
    table = NodeTable()
    cap = NodeCapacity(1, 1, 0)
    holder = table.register(b"twin/1", NodeRegister("twin", "1", "h", 1, cap), proof="key-a")
    assert table.claim_conflict(b"twin/2", "twin", "key-b") is holder, "another peer may not take a live name"
    assert table.claim_conflict(b"twin/2", "twin", "key-a") is None, "the same node restarted proves it"
    assert table.claim_conflict(b"twin/1", "twin", "key-b") is holder, "nor take over a live link's id"
    assert isinstance(holder, NodeEntry) and table.replaced_by(b"twin/2", "twin") == [holder]


def _twin_setup(base: Path, transport: str, heartbeats: tuple[str, ...] = FAST_HEARTBEATS,
                same_key: bool = False) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
    """Router args and, per node, its args to join: over ipc, or over TCP each with its own listed
    key (``same_key``: both with one, as one node restarted elsewhere)."""
    if transport == "ipc":
        return heartbeats, [("--router", f"ipc://{base}/router/nodes.sock")] * 2
    keys, allowed = base / "keys", base / "nodes"
    allowed.mkdir()
    router_pub, router_sec = keygen(keys, "router")
    port = free_port()
    router = (*heartbeats, "--node-bind", f"tcp://127.0.0.1:{port}", "--curve-secret-key-file", str(router_sec),
              "--client-keys-dir", str(allowed), "--node-keys-dir", str(allowed))
    nodes = []
    for name in ("twin-a", "twin-a" if same_key else "twin-b"):
        public, secret = keygen(keys, name) if not (keys / f"{name}.key").exists() else (
            keys / f"{name}.key", keys / f"{name}.key_secret")
        shutil.copy(public, allowed)
        nodes.append(("--router", f"tcp://127.0.0.1:{port}", "--curve-secret-key-file", str(secret),
                      "--router-public-key-file", str(router_pub)))
    return router, nodes


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_a_live_nodes_name_is_refused_to_another_peer(short_tmp: Path, transport: str) -> None:
    router_dir, dirs = short_tmp / "router", [short_tmp / "n0", short_tmp / "n1"]
    router_args, joins = _twin_setup(short_tmp, transport)
    with router_daemon(router_dir, *router_args) as address:
        pids: list[list[int]] = []
        try:
            for d, join in zip(dirs, joins):
                start_nodes([d], *join, "--node-name", "twin", *NODE_ARGS)
                pids.append([int((d / "node.pid").read_text())])
            trainer = RawTrainer(address)
            try:
                wait_until(lambda: "refused this node" in (dirs[1] / "node.log").read_text(), JOIN_TIMEOUT_S,
                           "the second 'twin' refused")
                ids = [f"t{i}" for i in range(8)]
                for rid in ids:
                    trainer.send(rid, "debug.sleep", {"seconds": 0.3})
                answers = trainer.collect(ids, timeout_s=30, linger_s=1.0)
                trainer.send("st", "status", {})
                st = trainer.collect(["st"], timeout_s=5, linger_s=0)["st"][0][1]["result"]
            finally:
                trainer.close()
            assert all(len(a) == 1 and a[0][0] == REPLY for i, a in answers.items() if i != "st"), answers
            assert {answers[i][0][1]["result"]["run_dir"] for i in ids} == {str(dirs[0])}, "only the holder ran them"
            assert [n["name"] for n in st["nodes"]] == ["twin"] and st["counters"]["node_lost"] == 0, st
            assert st["counters"]["names_refused"] >= 1
            assert "is held by a live node" in (router_dir / "router.log").read_text()
        finally:
            for d, p in zip(dirs, pids):
                stop_node(d, p)


def test_a_restarted_node_proves_its_name_and_the_old_process_cannot_take_it_back(short_tmp: Path) -> None:
    """Over TCP the key proves the name: a new process with the node's key takes it over from a
    frozen old one at once (not after the heartbeat timeout); the old one, when it runs again, is
    refused instead of evicting the new one in turn."""
    router_dir, dirs = short_tmp / "router", [short_tmp / "n0", short_tmp / "n1"]
    slow = ("--heartbeat-interval-s", "0.5", "--heartbeat-timeout-s", "120")
    router_args, joins = _twin_setup(short_tmp, "tcp", slow, same_key=True)
    with router_daemon(router_dir, *router_args) as address:
        pids: list[list[int]] = []
        try:
            start_nodes([dirs[0]], *joins[0], "--node-name", "twin", *NODE_ARGS)
            pids.append([int((dirs[0] / "node.pid").read_text())])
            trainer = RawTrainer(address)
            trainer.send("st0", "status", {})
            assert trainer.collect(["st0"], timeout_s=5, linger_s=0)["st0"][0][0] == REPLY
            wait_until(lambda: "registered at router" in (dirs[0] / "node.log").read_text(), JOIN_TIMEOUT_S,
                       "the first process registered")
            os.kill(pids[0][0], signal.SIGSTOP)  # frozen: its connection stays open, it misses no deadline yet
            try:
                start_nodes([dirs[1]], *joins[1], "--node-name", "twin", *NODE_ARGS)
                pids.append([int((dirs[1] / "node.pid").read_text())])
                new = json.loads((dirs[1] / "router-link.json").read_text())["identity"]
                wait_until(lambda: _status(trainer)["nodes"][0]["identity"] == new, JOIN_TIMEOUT_S,
                           "the new process holding the name")
            finally:
                os.kill(pids[0][0], signal.SIGCONT)
            wait_until(lambda: "refused this node" in (dirs[0] / "node.log").read_text(), JOIN_TIMEOUT_S,
                       "the old process refused")
            ids = [f"t{i}" for i in range(4)]
            for rid in ids:
                trainer.send(rid, "debug.sleep", {"seconds": 0.1})
            answers = trainer.collect(ids, timeout_s=30, linger_s=0.5)
            st = _status(trainer)
            trainer.close()
            assert {answers[i][0][1]["result"]["run_dir"] for i in ids} == {str(dirs[1])}
            assert [n["identity"] for n in st["nodes"]] == [new]
            assert st["counters"]["node_lost"] == 1, "replaced once, never back and forth"
        finally:
            for d, p in zip(dirs, pids):
                stop_node(d, p)


def _status(trainer: RawTrainer) -> dict[str, Any]:
    trainer.answers.pop("status", None)
    trainer.send("status", "status", {})
    return trainer.collect(["status"], timeout_s=5, linger_s=0)["status"][0][1]["result"]


# --- requests owned by their client -------------------------------------------------------------------


def test_ids_belong_to_their_client(short_tmp: Path) -> None:
    with federation(short_tmp, 2) as fed:
        a, b, a2 = RawTrainer(fed.address, client="a"), RawTrainer(fed.address, client="b"), \
            RawTrainer(fed.address, client="a")
        try:
            a.send("x", "debug.sleep", {"seconds": 0.8})
            b.send("x", "debug.sleep", {"seconds": 0.1, "n_tokens": 4})  # another client's own "x"
            got_b = b.collect(["x"], timeout_s=10, linger_s=0)["x"]
            assert got_b[0][0] == REPLY and got_b[0][2] > 0, "b got its own answer (with arrays), not a's"
            a.send("y", "debug.sleep", {"seconds": 0.8})
            a.collect([], timeout_s=5, linger_s=0.2)
            b.cancel("y")  # not b's to cancel
            got_a = a.collect(["x", "y"], timeout_s=10, linger_s=0.3)
            assert [k for k, _, _ in got_a["x"]] == [REPLY] and got_a["x"][0][2] == 0
            assert [k for k, _, _ in got_a["y"]] == [REPLY], got_a["y"]
            # The same id again with other arguments: refused, naming the difference.
            a.send("x", "debug.sleep", {"seconds": 0.2})
            again = a.collect(["x"], timeout_s=5, linger_s=0.3)["x"]
            assert again[1][0] == ERROR and again[1][1]["code"] == "DUPLICATE_REQUEST", again
            assert "args.seconds" in again[1][1]["message"]
            # The same client on a second connection (it reconnected): both get the one answer.
            a.send("z", "debug.sleep", {"seconds": 0.8})
            a.collect([], timeout_s=5, linger_s=0.2)
            a2.send("z", "debug.sleep", {"seconds": 0.8})
            for t in (a, a2):
                got = t.collect(["z"], timeout_s=10, linger_s=0.3)["z"]
                assert [k for k, _, _ in got] == [REPLY], got
            assert a.answers["z"][0][1] == a2.answers["z"][0][1]
            assert fed.status()["counters"]["requests"] == 4, "x, x of b, y, z: each ran once"
        finally:
            for t in (a, b, a2):
                t.close()


# --- answers checked ----------------------------------------------------------------------------------


class FakeNode:
    """A node that answers what it is told to, right or wrong (a real socket, a misbehaving peer)."""

    def __init__(self, ctx: zmq.Context, address: str, name: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, f"{name}/1".encode())
        self.sock.connect(address)
        self.sock.send_multipart([b"", *node_message(NodeRegister(name, "1", "h", os.getpid(), NodeCapacity(1, 1, 0)))])

    def next_request(self, timeout_s: float) -> tuple[bytes, dict]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.sock.poll(50):
                frames = self.sock.recv_multipart()
                if frames[0]:
                    return frames[0], msgpack.unpackb(frames[2], raw=False)
        raise TimeoutError(f"no request reached the fake node within {timeout_s} s")

    def answer(self, envelope: bytes, rid: str) -> None:
        self.sock.send_multipart([envelope, *framing.encode(MsgType.REPLY, {"id": rid, "result": {"by": "fake"},
                                                                             "refs": []})])


def test_answers_must_match_the_request_and_come_from_its_node(short_tmp: Path) -> None:
    router_dir = short_tmp / "router"
    slow = ("--heartbeat-interval-s", "1", "--heartbeat-timeout-s", "30")
    with router_daemon(router_dir, *slow) as address:
        ctx = zmq.Context()
        trainer = RawTrainer(address)
        try:
            one = FakeNode(ctx, f"ipc://{router_dir}/nodes.sock", "fake-one")
            wait_until(lambda: one.sock.poll(50) and one.sock.recv_multipart(), JOIN_TIMEOUT_S, "a welcome")
            trainer.send("q", "debug.sleep", {"seconds": 0})
            envelope, header = one.next_request(JOIN_TIMEOUT_S)
            other = FakeNode(ctx, f"ipc://{router_dir}/nodes.sock", "fake-two")
            wait_until(lambda: other.sock.poll(50) and other.sock.recv_multipart(), JOIN_TIMEOUT_S, "a welcome")
            one.answer(envelope, "not-" + header["id"])  # the header names another request
            other.answer(envelope, header["id"])  # a node it was not sent to
            trainer.collect([], timeout_s=5, linger_s=0.5)
            assert trainer.answers == {}, "neither wrong answer reached the trainer"
            one.answer(envelope, header["id"])
            got = trainer.collect(["q"], timeout_s=5, linger_s=0.3)
            assert list(got) == ["q"] and [k for k, _, _ in got["q"]] == [REPLY] and got["q"][0][1]["result"] == {
                "by": "fake"}
            trainer.send("st", "status", {})
            counters = trainer.collect(["st"], timeout_s=5, linger_s=0)["st"][0][1]["result"]["counters"]
            assert counters["bad_answers"] == 2, counters
        finally:
            trainer.close()
            for n in ("one", "other"):
                if n in locals():
                    locals()[n].sock.close()
            ctx.term()


# --- a stalled node comes back -------------------------------------------------------------------------


def test_stalled_node_has_its_requeued_work_cancelled(short_tmp: Path) -> None:
    """Three rollouts on two nodes of two slots: the node with two stalls past the heartbeat
    timeout; one of its two goes to the other node's free slot, one waits at the router. When it
    comes back, the router cancels the first on it and lets it finish the second: one run each."""
    log = run_log(short_tmp)
    with federation(short_tmp, 2) as fed:
        trainer = RawTrainer(fed.address)
        try:
            ids = [f"st{i}" for i in range(3)]
            for rid in ids:
                trainer.send(rid, "rollout", counted_rollout(log, rid, 5.0))
            busy = wait_until(lambda: [fed.node_of(n["name"].split(":", 1)[1]) for n in fed.status()["nodes"]
                                       if n["in_flight"] == 2], JOIN_TIMEOUT_S, "two rollouts on one node")
            stalled = fed.node_pid(busy[0])
            os.kill(stalled, signal.SIGSTOP)
            try:
                wait_until(lambda: fed.status()["counters"]["node_lost"] == 1, JOIN_TIMEOUT_S, "the stall noticed")
            finally:
                os.kill(stalled, signal.SIGCONT)
            answers = trainer.collect(ids, timeout_s=60, linger_s=2.0)
        finally:
            trainer.close()
        assert all(len(answers[i]) == 1 and answers[i][0][0] == REPLY for i in ids), answers
        # The stalled node's copies would have ended by now (5 s): one run each, no more.
        wait_until(lambda: not any(n["in_flight"] for n in fed.status()["nodes"]), JOIN_TIMEOUT_S, "idle nodes")
        assert runs(log) == {rid: 1 for rid in ids}, runs(log)
        counters = fed.status()["counters"]
        assert (counters["cancelled_on_return"], counters["resumed_on_return"]) == (1, 1), counters


# --- the router restarts ----------------------------------------------------------------------------------


async def _restart_batch(fed: Federation, log: Path, ids: list[str]) -> tuple[list[Any], list[Any], float]:
    async with AsyncRolloutClient(fed.address, timeout_s=60) as c:
        submitted = {rid: counted_request(log, rid, 3.0) for rid in ids}
        await c.submit(list(submitted.values()))
        await asyncio.to_thread(wait_until, lambda: sum(n["in_flight"] for n in fed.status()["nodes"]) == 4,
                                JOIN_TIMEOUT_S, "four rollouts on the nodes")
        os.kill(_router_pid(fed.router_dir), signal.SIGKILL)
        killed_at = time.monotonic()
        first = [r async for r in c.as_completed(ids)]  # no timeout: bounded all the same
        lost_after_s = time.monotonic() - killed_at
        await asyncio.to_thread(start_router, fed.router_dir, *FAST_HEARTBEATS)
        await asyncio.to_thread(fed.wait_nodes, 2)
        # The lost ids again: collected from the nodes (finished or still running), not run again.
        lost = [r.request_id for r in first if isinstance(r.error, DaemonLost)]
        await c.submit([submitted[rid] for rid in lost])
        second = list((await c.results(lost, timeout_s=60)).values())
    return first, second, lost_after_s


def test_router_killed_and_restarted_loses_nothing_and_runs_nothing_twice(short_tmp: Path) -> None:
    log = run_log(short_tmp)
    with federation(short_tmp, 2) as fed:
        ids = [f"rr{i}" for i in range(4)]
        # The sync helpers (status, start) run in threads: the client's loop is this one.
        first, second, lost_after_s = asyncio.run(_restart_batch(fed, log, ids))
        counters = fed.status()["counters"]
    assert len(first) == 4 and all(r.error is None or isinstance(r.error, DaemonLost) for r in first), first
    lost = sorted(r.request_id for r in first if r.error is not None)
    assert lost and lost_after_s < LOST_BOUND_S, "the kill came while they ran: failed at once, not waited on"
    assert sorted(r.request_id for r in second) == lost and all(r.error is None for r in second), second
    assert all(len(r.trajectories) == 1 and r.trajectories[0].request_id == r.request_id for r in second)
    assert runs(log) == {rid: 1 for rid in ids}, runs(log)
    assert counters["bad_answers"] == 0, counters


# --- the trainer reconnects -----------------------------------------------------------------------------------


def test_answer_arriving_while_its_trainer_reconnects_is_kept_with_arrays(short_tmp: Path) -> None:
    log = run_log(short_tmp)
    with federation(short_tmp, 1) as fed:
        gone = RawTrainer(fed.address, client="c")
        gone.send("rc", "rollout", counted_rollout(log, "rc", 1.0))
        wait_until(lambda: fed.status()["in_flight"] == 1, JOIN_TIMEOUT_S, "the request at the router")
        gone.close()  # it reconnects as a new connection before its answer comes
        wait_until(lambda: fed.status()["in_flight"] == 0 and runs(log)["rc"], 30, "the answer at the router")
        back = RawTrainer(fed.address, client="c")
        try:
            back.send("rc", "rollout", counted_rollout(log, "rc", 1.0))
            got = back.collect(["rc"], timeout_s=10, linger_s=0.5)["rc"]
        finally:
            back.close()
    assert [k for k, _, _ in got] == [REPLY] and got[0][2] > 0, got
    assert runs(log) == {"rc": 1}
