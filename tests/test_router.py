"""Federation: a router in front of node daemons, all real processes on this machine."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import uvloop

from daemon_fixtures import CLI, start_nodes, start_router, stop_node, stop_router
from router_support import FAST_HEARTBEATS, Federation, RawTrainer, federation, keygen
from support.net import free_port
from support.waits import wait_until
from rolloutd.client.async_client import AsyncRolloutClient, RolloutRequest
from rolloutd.client.sync_client import RolloutClient
from rolloutd.daemon.router.dispatch import Hints, NodeEntry, pick_node, routing_hints
from rolloutd.native_io.curve import CurveClient
from rolloutd.native_io.errors import BadRequest, ConfigError, PermissionDenied, SandboxLost
from rolloutd.native_io.wire import MsgType, NodeCapacity

REPLY, ERROR = MsgType.REPLY.value, MsgType.ERROR.value
NODE_BUSY_TIMEOUT_S = 10.0
"""Requests sent through the router reach a ready node's workers well within this."""
REFUSAL_TIMEOUT_S = 15.0
"""A node started and ready tries its handshake at once; the refusal is logged as it happens."""


@pytest.fixture(scope="module")
def fed3() -> Iterator[Federation]:
    """Three nodes behind a router, shared by the tests that leave them as they found them."""
    base = Path(tempfile.mkdtemp(prefix="rld-"))
    try:
        with federation(base, 3) as fed:
            yield fed
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _run_dirs(results: list[dict]) -> collections.Counter[str]:
    return collections.Counter(r["run_dir"] for r in results)


# --- dispatch rules, on the router's own data structures ---------------------------------------


def _node(name: str, slots: int, images: tuple[str, ...] = ()) -> NodeEntry:
    return NodeEntry(name.encode(), name, "h", 1, NodeCapacity(slots, 1, 0, images=list(images)))


def test_dispatch_keeps_a_task_together_while_it_fits() -> None:
    a, b = _node("a", 4), _node("b", 4)
    task = routing_hints("rollout", {"task": {"instance_id": "django-123", "dataset": "/data/swe.jsonl"}, "n": 2})
    assert (task.cost, task.affinity) == (2, "/data/swe.jsonl/django-123")
    first = pick_node([a, b], task)
    assert first is a
    a.take("r1", 2)
    # Alone, b is the least loaded; the same instance still goes to a while a has room.
    assert pick_node([a, b], task, preferred=a) is a
    a.take("r2", 2)
    assert pick_node([a, b], task, preferred=a) is b, "a is full: the task spills over"
    b.take("r3", 4)
    assert pick_node([a, b], task, preferred=a) is None, "no room anywhere: the request waits"
    a.finish("r1")
    assert pick_node([a, b], task, preferred=a) is a


def test_dispatch_prefers_warm_images_and_never_starves_big_requests() -> None:
    a, b = _node("a", 2), _node("b", 2, images=("swe:py311",))
    assert pick_node([a, b], routing_hints("sandbox.open", {"image": "swe:py311"})) is b
    assert pick_node([a, b], routing_hints("sandbox.open", {"image": "other"})) is a
    big = routing_hints("rollout", {"task": {"instance_id": 7}, "n": 16})
    assert pick_node([a, b], big) is a, "too large for any node: it runs alone on an idle one"
    a.take("x", 1)
    b.take("y", 1)
    assert pick_node([a, b], big) is None
    b.draining = True
    b.finish("y")
    assert pick_node([a, b], big) is None and pick_node([b], Hints()) is None, "a draining node takes nothing new"
    assert pick_node([a, b], Hints()) is a
    with pytest.raises(BadRequest, match="sandbox_id"):
        routing_hints("sandbox.run", {"command": "ls"})


# --- a shared three-node federation ----------------------------------------------------------------


async def test_batch_spreads_over_nodes_with_arrays_as_frames(fed3: Federation) -> None:
    async with AsyncRolloutClient(fed3.address) as c:
        before = {n["name"]: n["dispatched"] for n in (await c.status())["nodes"]}
        replies = await asyncio.gather(*(c.request("debug.sleep", {"seconds": 0.3, "n_tokens": 16})
                                         for _ in range(12)))
        st = await c.status()
    spread = _run_dirs([r.result for r in replies])
    assert set(spread) == {str(d) for d in fed3.node_dirs}, spread
    assert all(v >= 2 for v in spread.values()), spread
    for r in replies:
        assert r.segments == [], "a router's client gets raw frames, never another node's shared memory"
        np.testing.assert_array_equal(r.arrays["response_ids"], np.arange(16, dtype=np.int32))
        assert r.arrays["response_logprobs"].dtype == np.float32
    assert sum(n["dispatched"] - before[n["name"]] for n in st["nodes"]) == 12
    for n in st["nodes"]:
        assert n["in_flight"] == 0 and n["used"] == 0 and n["slots"] == 2
        assert 0 <= n["heartbeat_age_s"] < 1.0 and n["reported"]["workers_ready"] == 1
    out = subprocess.run([*CLI, "router", "status", "--run-dir", str(fed3.router_dir), "--json"],
                         capture_output=True, text=True, check=True)
    assert len(json.loads(out.stdout)["nodes"]) == 3
    table = subprocess.run([*CLI, "router", "status", "--run-dir", str(fed3.router_dir)],
                           capture_output=True, text=True, check=True).stdout
    assert all(f"{socket.gethostname()}:{d}" in table for d in fed3.node_dirs), table


def test_sandbox_ops_follow_their_sandbox(fed3: Federation) -> None:
    with RolloutClient(fed3.address) as c:
        boxes = [c.open_sandbox(ipython=False) for _ in range(3)]
        homes = {b.run("pwd").output.rsplit("/w0/", 1)[0] for b in boxes}
        assert homes == set(fed3.sandbox_dirs), "sandboxes count as load: one per node"
        assert fed3.status()["sandboxes"] == 3
        for b in boxes:
            assert b.run("echo $((6*7))").output == "42\n"
            b.close()
        with pytest.raises(SandboxLost):
            boxes[0].run("echo closed")
        with pytest.raises(SandboxLost):
            c.request("sandbox.run", {"sandbox_id": "nonexistent", "command": "ls"})
    assert fed3.status()["sandboxes"] == 0


def test_repeated_ids_get_one_answer_and_same_instance_one_node(fed3: Federation) -> None:
    trainer = RawTrainer(fed3.address)
    try:
        trainer.send("dup-1", "debug.sleep", {"seconds": 0.3})
        trainer.send("dup-1", "debug.sleep", {"seconds": 0.3})
        answers = trainer.collect(["dup-1"], timeout_s=10, linger_s=0.5)
        assert len(answers["dup-1"]) == 1 and answers["dup-1"][0][0] == REPLY
        trainer.send("dup-1", "debug.sleep", {"seconds": 0.3})
        again = trainer.collect(["dup-1"], timeout_s=10, linger_s=0.3)["dup-1"]
        assert len(again) == 2 and again[1][1] == again[0][1], "a finished id is answered from the record"
        before = {n["name"]: n["dispatched"] for n in fed3.status()["nodes"]}
        # The same task instance lands on one node each time, where plain load balancing would
        # rotate (the node then says it has no such task: routing is what is tested here).
        for i in range(4):
            trainer.send(f"inst-{i}", "rollout", {"task": {"instance_id": "no-such-task-42"}, "n": 1})
            got = trainer.collect([f"inst-{i}"], timeout_s=30, linger_s=0)[f"inst-{i}"]
            assert got[0][0] == ERROR, got
        after = {n["name"]: n["dispatched"] for n in fed3.status()["nodes"]}
        assert sorted(after[k] - before[k] for k in after) == [0, 0, 4]
        trainer.send("", "status", {})
        assert trainer.collect([""], timeout_s=5, linger_s=0)[""][0][1]["code"] == "BAD_REQUEST"
    finally:
        trainer.close()


def test_two_trainers_asking_one_id_in_flight_both_get_the_answer(fed3: Federation) -> None:
    """The router joins a second asker of a running id instead of moving the answer to it (issue
    27: the first asker never heard back)."""
    first, second = RawTrainer(fed3.address), RawTrainer(fed3.address)
    try:
        first.send("both-1", "debug.sleep", {"seconds": 1.0})
        first.collect([], timeout_s=5, linger_s=0.2)  # its request reached the router first
        second.send("both-1", "debug.sleep", {"seconds": 1.0})
        for trainer in (first, second):
            got = trainer.collect(["both-1"], timeout_s=15, linger_s=0.3)["both-1"]
            assert [kind for kind, _, _ in got] == [REPLY], got
    finally:
        first.close()
        second.close()


def _located(fed: Federation, iid: str, commands: list[str]) -> RolloutRequest:
    """A real rollout (script agent, inline command task) whose reward is the index of the node
    whose sandbox folder it ran in."""
    where = " ".join(f"{d}/*) echo {i};;" for i, d in enumerate(fed.sandbox_dirs))
    record = {"type": "command", "instance_id": iid, "eval_script": f'case "$PWD" in {where} *) echo 9;; esac'}
    return RolloutRequest(task=record, agent="script", agent_config={"commands": commands}, ipython=False)


async def test_rollouts_of_one_task_stay_on_one_node(fed3: Federation) -> None:
    async with AsyncRolloutClient(fed3.address, timeout_s=60) as c:
        # Two requests per task instance, interleaved; each node has two slots.
        ids = await c.submit([_located(fed3, iid, ["sleep 0.2"]) for iid in ("alpha", "beta", "gamma") * 2])
        results = await c.results(ids, timeout_s=60)
    by_task: dict[str, set[float]] = collections.defaultdict(set)
    for rid, result in results.items():
        assert result.error is None, result.error
        (traj,) = result.trajectories
        assert traj.finish_reason == "completed" and "error" not in traj.metrics["eval"], traj.metrics
        by_task[traj.task_id].add(traj.reward)
    assert all(len(nodes) == 1 for nodes in by_task.values()), by_task
    assert sorted(r for nodes in by_task.values() for r in nodes) == [0.0, 1.0, 2.0], "one node per task"


# --- failures --------------------------------------------------------------------------------------


def test_node_killed_mid_batch_every_trajectory_answered_once(short_tmp: Path) -> None:
    # A long heartbeat timeout: the router must notice the closed connection itself.
    with federation(short_tmp, 3, router_args=("--heartbeat-interval-s", "0.2", "--heartbeat-timeout-s", "30")) as fed:
        with RolloutClient(fed.address) as c:  # applied by every node, and by any that joins later
            assert sorted(c.set_weight_version("w7")["nodes"]) == sorted(n["name"] for n in fed.status()["nodes"])
        trainer = RawTrainer(fed.address)
        try:
            ids = [f"k{i}" for i in range(12)]
            for rid in ids:  # six start at once (two per node), six wait at the router
                trainer.send(rid, "rollout", _located(fed, rid, ["sleep 0.6"]).to_args())
            _wait_state(fed, str(fed.node_dirs[1]), "ready", busy=True)
            os.kill(fed.node_pid(1), signal.SIGKILL)
            answers = trainer.collect(ids, timeout_s=60, linger_s=1.0)
        finally:
            trainer.close()
        assert all(len(answers[i]) == 1 for i in ids), {i: len(a) for i, a in answers.items()}
        assert all(a[0][0] == REPLY and a[0][2] == 6 for a in answers.values()), "replies with their six arrays"
        trajectories = [t for a in answers.values() for t in a[0][1]["result"]["trajectories"]]
        assert len(trajectories) == 12 and {t["finish_reason"] for t in trajectories} == {"completed"}
        assert {t["reward"] for t in trajectories} == {0.0, 2.0}, "all from the nodes that lived"
        st = fed.status()
        assert len(st["nodes"]) == 2 and st["counters"]["node_lost"] == 1 and st["counters"]["redispatched"] == 2
        assert st["in_flight"] == 0
        # The node comes back (a new process, same folder and name) and is used again.
        fed.start([1])
        st = fed.wait_nodes(3)
        assert str(fed.node_dirs[1]) in _batch(fed.address, 6, 0.2), "the node that came back is used again"
        back = [n for n in fed.status()["nodes"] if n["name"].endswith(f":{fed.node_dirs[1]}")]
        assert back[0]["setup_applied"] == 1, "it got the weight version the others have"


def _batch(address: str, n: int, seconds: float) -> collections.Counter[str]:
    """Run ``n`` sleeps at once through ``address``; how many each node folder ran."""
    async def go() -> list:
        async with AsyncRolloutClient(address, timeout_s=30) as c:
            return await asyncio.gather(*(c.request("debug.sleep", {"seconds": seconds}) for _ in range(n)))

    return _run_dirs([r.result for r in uvloop.run(go())])


def test_silent_node_is_dropped_its_late_answers_discarded_and_it_rejoins(short_tmp: Path) -> None:
    with federation(short_tmp, 2) as fed:
        trainer = RawTrainer(fed.address)
        try:
            ids = [f"s{i}" for i in range(8)]
            for rid in ids:
                trainer.send(rid, "debug.sleep", {"seconds": 0.6})
            _wait_node_running(fed.node_dirs[0], 1)
            stalled = fed.node_pid(0)
            # Stop the node's supervisor only: its workers finish and answer into a frozen process,
            # which sends those answers once it runs again, long after the router gave up on it.
            os.kill(stalled, signal.SIGSTOP)
            try:
                answers = trainer.collect(ids, timeout_s=30, linger_s=0.2)
                assert fed.status()["counters"]["node_lost"] == 1
            finally:
                os.kill(stalled, signal.SIGCONT)
            st = fed.wait_nodes(2)
            more = trainer.collect(ids, timeout_s=5, linger_s=1.0)
        finally:
            trainer.close()
        assert all(len(more[i]) == 1 and more[i][0][0] == REPLY for i in ids), {i: len(a) for i, a in more.items()}
        assert answers == more
        assert st["counters"]["late_dropped"] >= 2 and st["counters"]["redispatched"] == 2
        assert str(fed.node_dirs[0]) in _batch(fed.address, 4, 0.2), "the node that came back takes work again"


def test_drain_finishes_what_it_has_takes_nothing_new_then_resumes(short_tmp: Path) -> None:
    with federation(short_tmp, 2) as fed:
        drained = str(fed.node_dirs[0])
        trainer = RawTrainer(fed.address)
        try:
            ids = [f"d{i}" for i in range(4)]
            for rid in ids:
                trainer.send(rid, "debug.sleep", {"seconds": 1.0})
            for d in fed.node_dirs:
                _wait_node_running(d, 2)
            drain = subprocess.Popen([*CLI, "node", "drain", "--run-dir", drained, "--wait-s", "10"],
                                     stdout=subprocess.PIPE, text=True)
            _wait_state(fed, drained, "draining")
            second = _batch(fed.address, 4, 0.1)
            out, _ = drain.communicate(timeout=15)
            assert drain.returncode == 0 and "drained: no request in flight" in out, out
            first = trainer.collect(ids, timeout_s=10, linger_s=0)
        finally:
            trainer.close()
        assert _run_dirs([a[0][1]["result"] for a in first.values()])[drained] == 2, "what it had, it finished"
        assert drained not in second, "nothing new went to it"
        subprocess.run([*CLI, "node", "drain", "--resume", "--run-dir", drained], check=True, capture_output=True)
        _wait_state(fed, drained, "ready")
        assert drained in _batch(fed.address, 4, 0.2), "after resume it takes work again"
    bad = subprocess.run([*CLI, "node", "drain", "--run-dir", drained], capture_output=True, text=True)
    assert bad.returncode == 2 and "no node daemon running" in bad.stderr


def _wait_node_running(run_dir: Path, n: int) -> None:
    """Until the node on ``run_dir`` itself (not the router's view of it) has ``n`` requests in flight."""
    with RolloutClient(f"ipc://{run_dir}/node.sock", timeout_s=5) as node:
        wait_until(lambda: sum(w["in_flight"] for w in node.status()["workers"]) >= n, NODE_BUSY_TIMEOUT_S,
                   f"{n} requests on the workers of {run_dir}")


def _wait_state(fed: Federation, run_dir: str, state: str, timeout_s: float = 10.0, busy: bool = False) -> None:
    """Until the router sees the node on ``run_dir`` in ``state`` (and, if ``busy``, with work)."""
    deadline = time.monotonic() + timeout_s
    while True:
        nodes = [n for n in fed.status()["nodes"] if n["name"].endswith(f":{run_dir}")]
        if [n["state"] for n in nodes] == [state] and (not busy or nodes[0]["in_flight"]):
            return
        assert time.monotonic() < deadline, f"{run_dir} never became {state}: {fed.status()['nodes']}"
        time.sleep(0.02)


def test_router_restart_nodes_register_again(short_tmp: Path) -> None:
    with federation(short_tmp, 3) as fed, RolloutClient(fed.address, timeout_s=20) as c:
        assert c.request("debug.sleep", {"seconds": 0}).result["run_dir"] in {str(d) for d in fed.node_dirs}
        stop_router(fed.router_dir, int((fed.router_dir / "router.pid").read_text()))
        pid = start_router(fed.router_dir, *FAST_HEARTBEATS)  # stopped by the fixture
        st = fed.wait_nodes(3, timeout_s=10)
        assert st["counters"]["nodes_joined"] == 3 and st["pid"] == pid
        assert len(_batch(fed.address, 6, 0.1)) == 3
        # A client connected before the restart reconnects to the new router by itself.
        assert c.request("debug.sleep", {"seconds": 0}).result["run_dir"] in {str(d) for d in fed.node_dirs}


# --- security ----------------------------------------------------------------------------------------


def test_tcp_needs_listed_keys_and_refuses_and_logs_the_rest(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    keys, trainers, nodes = short_tmp / "keys", short_tmp / "trainers", short_tmp / "nodes"
    router_pub, router_sec = keygen(keys, "router")
    trainer_pub, trainer_sec = keygen(keys, "trainer")
    _, stranger_sec = keygen(keys, "stranger")
    node_pub, node_sec = keygen(keys, "node")
    _, rogue_sec = keygen(keys, "rogue")
    for folder, pub in ((trainers, trainer_pub), (nodes, node_pub)):
        folder.mkdir()
        shutil.copy(pub, folder)
    again = subprocess.run([*CLI, "keygen", "router", "--dir", str(keys)], capture_output=True, text=True)
    assert again.returncode == 2 and "never overwritten" in again.stderr
    unkeyed = subprocess.run([*CLI, "router", "start", "--run-dir", str(short_tmp / "x"), "--tcp-bind",
                              "tcp://127.0.0.1:1"], capture_output=True, text=True)
    assert unkeyed.returncode == 2 and "never listens on TCP without authentication" in unkeyed.stderr
    trainer_port, node_port = free_port(), free_port()
    router_dir = short_tmp / "router"
    router_args = (*FAST_HEARTBEATS, "--tcp-bind", f"tcp://127.0.0.1:{trainer_port}", "--node-bind",
                   f"tcp://127.0.0.1:{node_port}", "--curve-secret-key-file", str(router_sec),
                   "--client-keys-dir", str(trainers), "--node-keys-dir", str(nodes))
    pid = start_router(router_dir, *router_args)
    good, rogue = short_tmp / "n0", short_tmp / "n1"
    try:
        common = ("--backend", "local", "--workers", "1", "--warm", "0", "--debug-ops", "--router", f"tcp://127.0.0.1:{node_port}",
                  "--router-public-key-file", str(router_pub))
        start_nodes([good], *common, "--curve-secret-key-file", str(node_sec))
        start_nodes([rogue], *common, "--curve-secret-key-file", str(rogue_sec))
        fed = Federation(router_dir, f"ipc://{router_dir}/router.sock", [good, rogue], ())
        fed.wait_nodes(1)
        # A negative check needs proof that the attempt happened: the router refused the rogue's
        # key, and the rogue is not a node.
        rogue_key = CurveClient(rogue_sec, str(router_pub)).public.decode()
        wait_until(lambda: rogue_key in (router_dir / "router.log").read_text(), REFUSAL_TIMEOUT_S,
                   "the router refusing the rogue node")
        assert [n["name"].split(":", 1)[1] for n in fed.status()["nodes"]] == [str(good)]

        address = f"tcp://127.0.0.1:{trainer_port}"
        monkeypatch.setenv("ROLLOUTD_ADDRESS", address)
        monkeypatch.delenv("ROLLOUTD_CURVE_SECRET_KEY_FILE", raising=False)
        with pytest.raises(ConfigError, match="ROLLOUTD_CURVE_SECRET_KEY_FILE"):
            RolloutClient()
        monkeypatch.setenv("ROLLOUTD_CURVE_SECRET_KEY_FILE", str(trainer_sec))
        monkeypatch.setenv("ROLLOUTD_CURVE_SERVER_KEY", str(router_pub))
        with RolloutClient(timeout_s=10) as c:  # the same API as on one node, only the environment differs
            reply = c.request("debug.sleep", {"seconds": 0.0, "n_tokens": 4})
            assert reply.result["run_dir"] == str(good) and reply.arrays["response_mask"].tolist() == [1] * 4
        with RolloutClient(address, timeout_s=10, curve=CurveClient(stranger_sec, str(router_pub))) as c:
            with pytest.raises(PermissionDenied, match="refused this client"):
                c.status()
        plain = RawTrainer(address)
        try:
            plain.send("p1", "status", {})
            assert not plain.sock.poll(1000), "a client without CURVE must get nothing"
        finally:
            plain.close()
    finally:
        for d in (good, rogue):
            if (d / "node.pid").exists():
                stop_node(d, [int((d / "node.pid").read_text())])
        stop_router(router_dir, pid)
    log = (router_dir / "router.log").read_text()
    assert "refused nodes peer 127.0.0.1" in log and CurveClient(rogue_sec, str(router_pub)).public.decode() in log
    assert "refused trainers peer 127.0.0.1" in log and "Unknown key" in log
    assert "refused a trainers connection" in log, "a client without CURVE is logged too"
    assert "refused this node" in (rogue / "node.log").read_text()


def test_tcp_router_address_without_keys_is_a_config_error(short_tmp: Path) -> None:
    out = subprocess.run([*CLI, "node", "start", "--run-dir", str(short_tmp), "--router", "tcp://127.0.0.1:9"],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "curve_secret_key_file" in out.stderr


def test_client_refuses_tcp_without_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROLLOUTD_CURVE_SECRET_KEY_FILE", raising=False)
    with pytest.raises(ConfigError, match="never talks over TCP unauthenticated"):
        RolloutClient("tcp://127.0.0.1:9", curve=None)


# --- apptainer ---------------------------------------------------------------------------------------


@pytest.mark.apptainer
def test_apptainer_sandboxes_on_two_nodes(short_tmp: Path) -> None:
    node_args = ("--backend", "apptainer", "--workers", "1", "--warm", "1", "--router-slots", "1")
    with federation(short_tmp, 2, node_args=node_args) as fed, RolloutClient(fed.address) as c:
        boxes = [c.open_sandbox(ipython=True) for _ in range(2)]
        try:
            assert all(b.info["backend"] == "apptainer" and b.info["isolated"] for b in boxes)
            for b in boxes:
                assert b.run("head -1 /etc/os-release").output.startswith('PRETTY_NAME="Debian')
            assert [b.ipython("6 * 7").result for b in boxes] == ["42", "42"]
            owners = {n["name"]: n["sandboxes"] for n in fed.status()["nodes"]}
            assert sorted(owners.values()) == [1, 1], "one sandbox per node (one slot each)"
        finally:
            for b in boxes:
                b.close()

