"""What the router costs and what it buys: the per-request overhead of the extra hop against a
client talking to the node directly (ipc, and TCP with CURVE on every hop), and throughput of a
fixed non-CPU-bound workload (requests that sleep in a worker) over 1, 2 and 4 node daemons.

Every node daemon is a separate process with its own run folder; all on this machine, so the
overhead rows include the extra context switches a router process costs on a small machine.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from common import check_targets, print_table, standard_args, summary_ms, time_calls, write_json  # noqa: E402
from daemon_fixtures import router_daemon, start_nodes, stop_node  # noqa: E402
from router_support import Federation, federation  # noqa: E402
from support.net import free_port  # noqa: E402

from rolloutd.client.async_client import AsyncRolloutClient  # noqa: E402
from rolloutd.client.sync_client import RolloutClient  # noqa: E402
from rolloutd.native_io.curve import CurveClient, keygen  # noqa: E402

NODE = ("--backend", "local", "--workers", "1", "--warm", "0", "--debug-ops")
OP, ARGS = "debug.sleep", {"seconds": 0.0}
"""The probe: a request a worker answers at once, so the timing is all transport."""


def _p50_pair(direct: RolloutClient, routed: RolloutClient, n: int) -> tuple[dict[str, float], dict[str, float]]:
    """Both paths interleaved in rounds, so drift in machine load hits both alike."""
    d_samples: list[float] = []
    r_samples: list[float] = []
    time_calls(lambda: direct.request(OP, ARGS), 200)
    time_calls(lambda: routed.request(OP, ARGS), 200)
    for _ in range(10):
        d_samples += time_calls(lambda: direct.request(OP, ARGS), n // 10, warmup=0)
        r_samples += time_calls(lambda: routed.request(OP, ARGS), n // 10, warmup=0)
    return summary_ms(d_samples), summary_ms(r_samples)


def overhead_ipc(base: Path, n: int) -> tuple[dict[str, float], dict[str, float]]:
    with federation(base, 1, router_args=(), node_args=(*NODE, "--router-slots", "4")) as fed:
        with RolloutClient(f"ipc://{fed.node_dirs[0]}/node.sock", arrays="frames") as direct, \
                RolloutClient(fed.address, arrays="frames") as routed:
            return _p50_pair(direct, routed, n)


def overhead_tcp(base: Path, n: int) -> tuple[dict[str, float], dict[str, float]]:
    """Trainer -> node over TCP+CURVE, against trainer -> router -> node, both hops TCP+CURVE."""
    keys, trainers, nodes = base / "keys", base / "trainers", base / "nodes"
    router_pub, router_sec = keygen(keys, "router")
    node_pub, node_sec = keygen(keys, "node")
    trainer_pub, trainer_sec = keygen(keys, "trainer")
    for folder, pub in ((trainers, trainer_pub), (nodes, node_pub)):
        folder.mkdir()
        shutil.copy(pub, folder)
    t_port, n_port, direct_port = free_port(), free_port(), free_port()
    router_dir, node_dir = base / "router", base / "n0"
    with router_daemon(router_dir, "--tcp-bind", f"tcp://127.0.0.1:{t_port}", "--node-bind",
                       f"tcp://127.0.0.1:{n_port}", "--curve-secret-key-file", str(router_sec),
                       "--client-keys-dir", str(trainers), "--node-keys-dir", str(nodes)) as address:
        start_nodes([node_dir], *NODE, "--router", f"tcp://127.0.0.1:{n_port}", "--router-public-key-file",
                    str(router_pub), "--curve-secret-key-file", str(node_sec), "--tcp-bind",
                    f"tcp://127.0.0.1:{direct_port}", "--curve-allowed-keys-dir", str(trainers))
        pid = int((node_dir / "node.pid").read_text())
        try:
            Federation(router_dir, address, [node_dir], ()).wait_nodes(1)
            with RolloutClient(f"tcp://127.0.0.1:{direct_port}", curve=CurveClient(trainer_sec, str(node_pub))) as d, \
                    RolloutClient(f"tcp://127.0.0.1:{t_port}", curve=CurveClient(trainer_sec, str(router_pub))) as r:
                return _p50_pair(d, r, n)
        finally:
            stop_node(node_dir, [pid])


async def _drive(address: str, requests: int, seconds: float, concurrency: int) -> float:
    """Requests per second for ``requests`` sleeps, at most ``concurrency`` outstanding."""
    gate = asyncio.Semaphore(concurrency)
    async with AsyncRolloutClient(address, timeout_s=300) as c:

        async def one() -> None:
            async with gate:
                await c.request("debug.sleep", {"seconds": seconds})

        await asyncio.gather(*(one() for _ in range(20)))  # warm-up
        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(requests)))
        return requests / (time.perf_counter() - t0)


def throughput(base: Path, nodes: int, requests: int, seconds: float, slots: int) -> float:
    """The router holds what does not fit, so the trainer simply submits everything."""
    with federation(base / f"t{nodes}", nodes, router_args=(),
                    node_args=(*NODE, "--router-slots", str(slots))) as fed:
        return asyncio.run(_drive(fed.address, requests, seconds, requests))


def direct_throughput(base: Path, requests: int, seconds: float, slots: int) -> float:
    """The same workload straight to one node, the trainer itself keeping ``slots`` in flight."""
    with federation(base / "direct", 1, router_args=(), node_args=(*NODE, "--router-slots", str(slots))) as fed:
        return asyncio.run(_drive(f"ipc://{fed.node_dirs[0]}/node.sock", requests, seconds, slots))


def main() -> int:
    args = standard_args(__doc__.splitlines()[0]).parse_args()
    n = 1000 if args.quick else 4000
    requests, seconds, slots = (256, 0.1, 16) if args.quick else (512, 0.1, 16)
    base = Path(tempfile.mkdtemp(prefix="rld-bf-"))
    try:
        ipc_direct, ipc_routed = overhead_ipc(base / "ipc", n)
        tcp_direct, tcp_routed = overhead_tcp(base / "tcp", n)
        direct = direct_throughput(base, requests, seconds, slots)
        tput = {k: throughput(base, k, requests, seconds, slots) for k in (1, 2, 4)}
    finally:
        shutil.rmtree(base, ignore_errors=True)
    over_ipc = ipc_routed["p50_ms"] - ipc_direct["p50_ms"]
    over_tcp = tcp_routed["p50_ms"] - tcp_direct["p50_ms"]
    print_table(f"Request round trip, {OP} {ARGS} (n={n} each, interleaved)",
                ["path", "p50 ms", "p99 ms", "router adds p50 ms"], [
                    ["trainer -> node (ipc)", ipc_direct["p50_ms"], ipc_direct["p99_ms"], ""],
                    ["trainer -> router -> node (ipc)", ipc_routed["p50_ms"], ipc_routed["p99_ms"], over_ipc],
                    ["trainer -> node (tcp+CURVE)", tcp_direct["p50_ms"], tcp_direct["p99_ms"], ""],
                    ["trainer -> router -> node (tcp+CURVE)", tcp_routed["p50_ms"], tcp_routed["p99_ms"], over_tcp],
                ])
    ideal = slots / seconds
    rows = [["1 node, trainer direct (no router)", direct, direct / ideal, ""]]
    rows += [[f"{k} node(s) behind the router", tput[k], tput[k] / (k * ideal), tput[k] / (k * tput[1])]
             for k in (1, 2, 4)]
    print_table(f"Throughput: {requests} requests sleeping {seconds} s, {slots} slots per node "
                f"(ideal {ideal:.0f} req/s per node)", ["setup", "req/s", "of ideal", "scaling efficiency"], rows)
    results = {
        "router_overhead_p50_ms": over_tcp, "router_overhead_ipc_p50_ms": over_ipc,
        "direct_ipc_p50_ms": ipc_direct["p50_ms"], "routed_ipc_p50_ms": ipc_routed["p50_ms"],
        "direct_tcp_p50_ms": tcp_direct["p50_ms"], "routed_tcp_p50_ms": tcp_routed["p50_ms"],
        "direct_throughput_rps": direct, **{f"throughput_{k}_rps": v for k, v in tput.items()},
        "scaling_efficiency_2": tput[2] / (2 * tput[1]), "scaling_efficiency_4": tput[4] / (4 * tput[1]),
    }
    write_json(args.json, results)
    ok = check_targets([
        (f"router_overhead_p50_ms (tcp+CURVE) {over_tcp:.3f} <= 0.5", over_tcp <= 0.5),
        (f"router_overhead_ipc_p50_ms {over_ipc:.3f} <= 0.5", over_ipc <= 0.5),
        (f"scaling_efficiency_4 {results['scaling_efficiency_4']:.3f} >= 0.85",
         results["scaling_efficiency_4"] >= 0.85),
    ])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
