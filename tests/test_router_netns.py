"""Nodes that really are other hosts: each node daemon, the router and the trainer in a network
namespace of its own, linked by a bridge in the router's namespace, over TCP with CURVE only.
No address is added outside the namespaces. Root only (CI runs as root)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from daemon_fixtures import router_daemon, start_nodes, stop_node
from router_support import Federation, keygen

SUBNET = "10.231.7"
ROUTER_IP = f"{SUBNET}.1"
TESTS = Path(__file__).resolve().parent

TRAINER = """
import json, sys
sys.path.insert(0, sys.argv[1])
from router_support import RawTrainer
from rolloutd.native_io.curve import CurveClient
address, server_key, secret, prefix, n, seconds = sys.argv[2:]
trainer = RawTrainer(address, curve=CurveClient(secret, server_key))
ids = [f"{prefix}{i}" for i in range(int(n))]
for rid in ids:
    trainer.send(rid, "debug.sleep", {"seconds": float(seconds), "n_tokens": 8})
answers = trainer.collect(ids, timeout_s=60, linger_s=1.0)
trainer.close()
print(json.dumps({rid: [[t, h.get("result", {}).get("run_dir"), h.get("code"), frames] for t, h, frames in got]
                  for rid, got in answers.items()}))
"""


@dataclass
class Lan:
    router_ns: str
    trainer_ns: str
    node_ns: list[str]

    def ports(self) -> list[str]:
        """Bridge ports in the router's namespace, one per node namespace."""
        return [f"{ns[-6:]}p" for ns in self.node_ns]


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    assert out.returncode == 0, f"ip {' '.join(args)}: {out.stderr}"


@pytest.fixture
def lan() -> Iterator[Lan]:
    if os.getuid() != 0:
        pytest.fail("this test needs root to create network namespaces (CI runs as root)")
    tag = f"{os.getpid() % 0xFFFF:04x}"
    net = Lan(f"rld{tag}r", f"rld{tag}t", [f"rld{tag}n{i}" for i in range(3)])
    made: list[str] = []
    try:
        for ns in (net.router_ns, net.trainer_ns, *net.node_ns):
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", net.router_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", net.router_ns, "addr", "add", f"{ROUTER_IP}/24", "dev", "br0")
        _ip("-n", net.router_ns, "link", "set", "br0", "up")
        hosts = [(net.trainer_ns, 2, f"{net.trainer_ns[-6:]}p")] + [
            (ns, 11 + i, port) for i, (ns, port) in enumerate(zip(net.node_ns, net.ports()))]
        for ns, host, port in hosts:
            _ip("-n", net.router_ns, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", net.router_ns, "link", "set", port, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{SUBNET}.{host}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
        yield net
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _exec_in(ns: str) -> tuple[str, ...]:
    return ("ip", "netns", "exec", ns)


def _batch(net: Lan, keys: Path, prefix: str, n: int, seconds: float) -> subprocess.Popen[str]:
    return subprocess.Popen([*_exec_in(net.trainer_ns), sys.executable, "-c", TRAINER, str(TESTS),
                             f"tcp://{ROUTER_IP}:7002", str(keys / "router.key"), str(keys / "trainer.key_secret"),
                             prefix, str(n), str(seconds)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _answers(proc: subprocess.Popen[str]) -> dict[str, list[Any]]:
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err[-3000:]
    answers: dict[str, list[Any]] = json.loads(out)
    return answers


def test_three_hosts_one_cut_off_mid_batch_then_back(lan: Lan, short_tmp: Path) -> None:
    keys, trainers, nodes = short_tmp / "keys", short_tmp / "trainers", short_tmp / "nodes"
    keygen(keys, "router")
    trainers.mkdir()
    nodes.mkdir()
    shutil.copy(keygen(keys, "trainer")[0], trainers)
    for i in range(3):
        shutil.copy(keygen(keys, f"host{i}")[0], nodes)
    router_dir = short_tmp / "router"
    router_args = ("--heartbeat-interval-s", "0.2", "--heartbeat-timeout-s", "1.0",
                   "--node-bind", f"tcp://{ROUTER_IP}:7001", "--tcp-bind", f"tcp://{ROUTER_IP}:7002",
                   "--curve-secret-key-file", str(keys / "router.key_secret"),
                   "--client-keys-dir", str(trainers), "--node-keys-dir", str(nodes))
    node_dirs = [short_tmp / f"n{i}" for i in range(3)]
    with router_daemon(router_dir, *router_args, prefix=_exec_in(lan.router_ns)) as address:
        fed = Federation(router_dir, address, node_dirs, ())

        def start(i: int) -> None:
            start_nodes([node_dirs[i]], "--backend", "local", "--workers", "1", "--warm", "1", "--router-slots", "2",
                        "--debug-ops", "--node-name", f"host{i}", "--router", f"tcp://{ROUTER_IP}:7001",
                        "--curve-secret-key-file", str(keys / f"host{i}.key_secret"),
                        "--router-public-key-file", str(keys / "router.key"), prefixes=[_exec_in(lan.node_ns[i])])

        with ThreadPoolExecutor(3) as pool:
            list(pool.map(start, range(3)))
        pids = [int((d / "node.pid").read_text()) for d in node_dirs]
        try:
            st = fed.wait_nodes(3)
            assert sorted(n["name"] for n in st["nodes"]) == ["host0", "host1", "host2"]
            batch = _batch(lan, keys, "a", 18, 0.5)
            deadline = time.monotonic() + 20
            while not any(n["name"] == "host1" and n["in_flight"] for n in fed.status()["nodes"]):
                assert time.monotonic() < deadline and batch.poll() is None, "host1 never got work"
                time.sleep(0.02)
            _ip("-n", lan.router_ns, "link", "set", lan.ports()[1], "down")  # host1 drops off the network
            answers = _answers(batch)
            assert sorted(answers) == sorted(f"a{i}" for i in range(18))
            assert all(len(got) == 1 for got in answers.values()), "exactly one answer per id"
            assert all(got[0][0] == 2 and got[0][3] == 4 for got in answers.values()), "replies with their arrays"
            assert str(node_dirs[1]) not in {got[0][1] for got in answers.values()}
            st = fed.status()
            assert sorted(n["name"] for n in st["nodes"]) == ["host0", "host2"]
            assert st["counters"]["node_lost"] == 1 and st["counters"]["redispatched"] >= 1
            _ip("-n", lan.router_ns, "link", "set", lan.ports()[1], "up")
            fed.wait_nodes(3, timeout_s=45)  # TCP retransmits after its backoff; the node registers again
            again = _answers(_batch(lan, keys, "b", 12, 0.3))
            assert all(len(got) == 1 and got[0][0] == 2 for got in again.values())
            assert str(node_dirs[1]) in {got[0][1] for got in again.values()}, "host1 is used again"
        finally:
            for d, pid in zip(node_dirs, pids):
                stop_node(d, [pid])
