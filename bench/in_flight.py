"""Rollouts in flight on one node: how many the daemon holds at once, none lost, and the memory
each costs.

Per level N, N short rollouts (a ``command`` task, the CodeAct agent, the scripted reference
policy) are submitted at once. Turn 1 runs ``flock -s BARRIER true`` in the rollout's sandbox;
the bench holds that file locked, so every rollout that reaches its first tool call stays there,
holding its sandbox, its shell and its agent state, until all N are held. In flight is then read
twice, independently: the run stage's slots in use (the workers' stats) and the ``flock``
processes waiting on the host. At that moment the resident memory of the supervisor, the workers
and every sandbox process is summed (psutil); minus the same sum with the node idle, divided by N,
it is ``rss_mb_per_rollout`` (``pss_mb_per_rollout`` counts shared pages once, a fairer figure for
a thousand copies of one shell). Then the lock is released: turn 2 submits, the task's evaluation
prints 1, and every answer is counted. ``lost``: requests that came back with anything but a
completed trajectory of reward 1, or not at all. The stage events of the trajectories give the
exact largest number of rollouts between entering init and leaving eval at one instant
(``rollouts_in_flight_max``).

Backend: ``local`` by default (a sandbox is a PTY shell in a scratch folder): 1,000 Apptainer
instances on a 2-core machine take minutes to start and several processes each (``--backend
apptainer`` runs it that way; ``bench/burst_start.py`` measures instance starts).
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import secrets
import signal
import sys
import tempfile
import time
from contextlib import contextmanager
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from common import Panel, check_targets, daemon_cpu_s, plot_panels, print_table, standard_args, write_json  # noqa: E402
from daemon_fixtures import node_daemon  # noqa: E402

from rolloutd.client.async_client import AsyncRolloutClient, RolloutRequest  # noqa: E402
from rolloutd.cli.demo import policy_server  # noqa: E402
from rolloutd.daemon.node.config import load_config  # noqa: E402
from rolloutd.daemon.node.sandbox_user import workers_dir  # noqa: E402
from rolloutd.daemon.sandbox.base import SHARED_INSIDE  # noqa: E402

TASK_ID = "scale-hold"
BARRIER = "barrier"
HOLD_TIMEOUT_S = 1800.0
"""How long a rollout's first tool call may wait on the barrier (ramps of 1,000 take minutes here)."""
LIMIT_S = 1500.0
"""How long the bench waits for each step of a level (all held, all answered, idle again);
``--limit-s`` sets it."""
POLL_S = 0.5
PROGRESS_S = 10.0
TARGET_IN_FLIGHT = 1000


def plans(barrier_inside: str) -> dict[str, list[str]]:
    hold = json.dumps({"name": "bash", "arguments": {"command": f"flock -s {barrier_inside} true"}})
    return {TASK_ID: [f"Waiting for the others.\n<tool_call>\n{hold}\n</tool_call>",
                      'Done.\n<tool_call>\n{"name": "submit", "arguments": {}}\n</tool_call>']}


def request(i: int) -> RolloutRequest:
    task = {"type": "command", "instance_id": TASK_ID, "problem_statement": "Wait, then submit.",
            "eval_script": "echo 1"}
    return RolloutRequest(task=task, ipython=False, sampling={"max_tokens": 64, "seed": i}, infra_retries=0,
                          agent_config={"tools": ["bash", "submit"], "max_turns": 3,
                                        "command_timeout_s": HOLD_TIMEOUT_S},
                          timeout_s=2 * HOLD_TIMEOUT_S, run_timeout_s=2 * HOLD_TIMEOUT_S)


@contextmanager
def barrier_lock(paths: list[Path]) -> Iterator[list[int]]:
    """Every barrier file created (readable by the sandboxes) and locked exclusively; unlocked and
    closed at the end. The caller unlocks early to let the rollouts go."""
    fds = []
    try:
        for p in paths:
            p.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(p, os.O_RDONLY | os.O_CREAT, 0o644)
            os.fchmod(fd, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            fds.append(fd)
        yield fds
    finally:
        for fd in fds:
            os.close(fd)


def release(fds: list[int]) -> None:
    for fd in fds:
        fcntl.flock(fd, fcntl.LOCK_UN)


def node_processes(supervisor_pid: int) -> list[psutil.Process]:
    """The supervisor, its workers and every sandbox process. Sandbox processes are the workers'
    descendants; Apptainer's instance processes detach from them but keep their session, which
    is among the sessions of the worker's descendants (the shells run ``apptainer exec``)."""
    sup = psutil.Process(supervisor_pid)
    procs = {p.pid: p for p in [sup, *sup.children(recursive=True)]}
    sessions = set()
    for p in procs.values():
        try:
            sessions.add(os.getsid(p.pid))
        except ProcessLookupError:
            pass
    sessions.discard(os.getsid(supervisor_pid))
    for p in psutil.process_iter():
        try:
            if p.pid not in procs and os.getsid(p.pid) in sessions:
                procs[p.pid] = p
        except (ProcessLookupError, psutil.Error):
            pass
    return list(procs.values())


@dataclass
class Footprint:
    rss_mb: float
    pss_mb: float
    processes: int
    fds: int


def footprint(supervisor_pid: int) -> Footprint:
    rss = pss = 0
    n = fds = 0
    for p in node_processes(supervisor_pid):
        try:
            mem = p.memory_full_info()
            rss, pss, fds, n = rss + mem.rss, pss + mem.pss, fds + p.num_fds(), n + 1
        except psutil.Error:
            pass  # exited between the listing and the read
    return Footprint(rss / 2**20, pss / 2**20, n, fds)


def held_on_host(barrier_inside: str) -> int:
    """``flock`` processes waiting on the barrier: one per held rollout, counted from /proc."""
    count = 0
    for p in psutil.process_iter(["name", "cmdline"]):
        try:
            if p.info["name"] == "flock" and barrier_inside in (p.info["cmdline"] or []):
                count += 1
        except psutil.Error:
            pass
    return count


def run_stage_in_use(status: dict[str, Any]) -> int:
    return sum(int(w.get("pipeline", {}).get("stages", {}).get("run", {}).get("in_use", 0))
               for w in status["workers"])


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The largest number of intervals open at one instant."""
    edges = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    best = now = 0
    for _, step in edges:
        now += step
        best = max(best, now)
    return best


async def wait_idle(client: AsyncRolloutClient, warm: int, limit_s: float) -> dict[str, Any]:
    """The node with no request, its warm pool full and no sandbox still being destroyed (the idle
    baseline's state)."""
    deadline = time.monotonic() + limit_s
    while True:
        st = await client.status()
        destroying = sum(int(w.get("pool", {}).get("destroying", 0)) for w in st["workers"])
        if (st["in_flight"] == 0 and st["sandboxes"]["ready"] >= warm and not st["sandboxes"]["starting"]
                and not destroying):
            return st
        if time.monotonic() > deadline:
            raise TimeoutError(f"the node was not idle with {warm} warm sandboxes within {limit_s} s: {st}")
        await asyncio.sleep(POLL_S)


async def ramp(client: AsyncRolloutClient, n: int, barrier_inside: str, t0: float, limit_s: float) -> int:
    """Until all ``n`` rollouts wait on the barrier (their run-stage slots taken and their
    ``flock`` running: a slot alone may still be waiting for its first model turn), or
    ``limit_s``; the run-stage slots then in use."""
    held = on_host = 0
    shown = t0
    while time.monotonic() < t0 + limit_s:
        await asyncio.sleep(POLL_S)
        status = await client.status()
        held = run_stage_in_use(status)
        if held >= n:
            on_host = await asyncio.to_thread(held_on_host, barrier_inside)
            if on_host >= n:
                break
        if time.monotonic() - shown > PROGRESS_S:
            shown = time.monotonic()
            print(f"  {shown - t0:.0f} s: {held}/{n} in the run stage, {on_host} at the barrier; sandboxes "
                  f"{status['sandboxes']}", flush=True)
    return held


async def level(client: AsyncRolloutClient, n: int, barrier_paths: list[Path], barrier_inside: str,
                idle: Footprint, start: int, warm: int, limit_s: float) -> dict[str, Any]:
    """One level: N rollouts submitted at once, held, measured, released, answered, cleaned up."""
    with barrier_lock(barrier_paths) as fds:
        st = await client.status()
        cpu0, t0 = daemon_cpu_s(st), time.monotonic()
        ids = await client.submit([request(start + i) for i in range(n)])
        held = await ramp(client, n, barrier_inside, t0, limit_s)
        ramp_s = time.monotonic() - t0
        peak_flock = await asyncio.to_thread(held_on_host, barrier_inside)
        peak = await asyncio.to_thread(footprint, st["pid"])
        st_peak = await client.status()
        release(fds)
        t1 = time.monotonic()
        completed, lost_reasons, intervals, turns = 0, {}, [], 0
        async for result in client.as_completed(ids, timeout_s=limit_s):
            if result.error is not None:
                lost_reasons[result.error.code] = lost_reasons.get(result.error.code, 0) + 1
                continue
            for t in result.trajectories:
                if t.finish_reason == "completed" and t.reward == 1.0:
                    completed += 1
                else:
                    key = f"{t.finish_reason}:{t.error_code}"
                    lost_reasons[key] = lost_reasons.get(key, 0) + 1
                turns += t.num_turns
                events = t.metrics.get("stage_events", [])
                if events:
                    intervals.append((events[0][2], events[-1][2]))
            await client.release(result)
        drain_s = time.monotonic() - t1
    # Every sandbox destroyed and the warm pool full again: the rest of a rollout's cost.
    t2 = time.monotonic()
    cpu = daemon_cpu_s(await wait_idle(client, warm, limit_s)) - cpu0
    settle_s = time.monotonic() - t2
    return {"n": n, "held_run_stage": held, "held_flock": peak_flock, "in_flight_exact": max_overlap(intervals),
            "ramp_s": ramp_s, "drain_s": drain_s, "settle_s": settle_s, "completed": completed, "lost": n - completed,
            "lost_reasons": lost_reasons, "rss_mb_per_rollout": (peak.rss_mb - idle.rss_mb) / max(1, held),
            "pss_mb_per_rollout": (peak.pss_mb - idle.pss_mb) / max(1, held), "peak_rss_mb": peak.rss_mb,
            "peak_pss_mb": peak.pss_mb, "peak_processes": peak.processes, "peak_fds": peak.fds,
            "daemon_rss_mb": st_peak["memory_rss_bytes"] / 2**20,
            "daemon_cpu_ms_per_rollout": 1e3 * cpu / n, "daemon_cpu_ms_per_turn": 1e3 * cpu / max(1, turns)}


async def measure(address: str, levels: list[int], warm: int, barrier_paths: list[Path],
                  barrier_inside: str, limit_s: float) -> tuple[Footprint, list[dict[str, Any]]]:
    out = []
    async with AsyncRolloutClient(address) as client:
        idle_status = await wait_idle(client, warm, limit_s)
        idle = await asyncio.to_thread(footprint, idle_status["pid"])
        start = 0
        for n in levels:
            out.append(await level(client, n, barrier_paths, barrier_inside, idle, start, warm, limit_s))
            start += n
            r = out[-1]
            print(f"level {n}: held {r['held_run_stage']} (flock {r['held_flock']}, exact {r['in_flight_exact']}) "
                  f"in {r['ramp_s']:.1f} s, {r['completed']} completed, lost {r['lost']} {r['lost_reasons']}; "
                  f"answered in {r['drain_s']:.1f} s, idle again {r['settle_s']:.1f} s later",
                  flush=True)
    return idle, out


def main() -> int:
    # A SIGTERM (a timeout, a Ctrl-C from a wrapper) unwinds the with blocks: node and policy stop.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    parser = standard_args(__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["local", "apptainer"], default="local")
    parser.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")],
                        help="in-flight counts to run, comma-separated (default 50,100,300,1000; --quick 100,1000)")
    parser.add_argument("--limit-s", type=float, default=LIMIT_S,
                        help="seconds each step of a level may take (all held, all answered, idle again)")
    parser.add_argument("--plot", type=Path, help="write a PNG of CPU per rollout and memory per rollout vs in flight")
    args = parser.parse_args()
    levels = args.levels or ([100, TARGET_IN_FLIGHT] if args.quick else [50, 100, 300, TARGET_IN_FLIGHT])
    workers, warm_each = 2, 4
    work = Path(tempfile.mkdtemp(prefix="rld-if-"))
    work.chmod(0o755)  # the sandbox user reads the barrier here (local backend)
    run_dir = work / "node"
    config = load_config(overrides={"run_dir": str(run_dir)}, environ={})
    if args.backend == "local":
        barrier_inside, barrier_paths = str(work / BARRIER), [work / BARRIER]
    else:
        barrier_inside = f"{SHARED_INSIDE}/{BARRIER}"
        barrier_paths = [workers_dir(config) / f"w{i}" / "shared" / BARRIER for i in range(workers)]
    (work / "plans.json").write_text(json.dumps({"plans": plans(barrier_inside)}))
    api_key = secrets.token_hex(16)
    top = max(levels)
    env = {"ROLLOUTD_INFERENCE_API_KEY": api_key, "ROLLOUTD_WARM_IPYTHON": "0",
           "ROLLOUTD_RUN_CONCURRENCY": str(top + 64), "ROLLOUTD_INIT_CONCURRENCY": "64",
           "ROLLOUTD_EVAL_CONCURRENCY": "64"}
    with policy_server(work / "plans.json", api_key) as url:
        with node_daemon(run_dir, "--backend", args.backend, "--workers", str(workers), "--warm", str(warm_each),
                         "--inference-server", url, env=env) as address:
            # The barrier files go where the workers made their shared folders.
            idle, rows = asyncio.run(measure(address, levels, workers * warm_each, barrier_paths, barrier_inside,
                                         args.limit_s))
    top_row = max(rows, key=lambda r: r["n"])
    results: dict[str, Any] = {
        "backend": args.backend, "workers": workers, "levels": levels,
        "rollouts_in_flight_max": max(min(r["held_run_stage"], r["held_flock"], r["in_flight_exact"]) for r in rows),
        "lost": sum(r["lost"] for r in rows), "rss_mb_per_rollout": top_row["rss_mb_per_rollout"],
        "pss_mb_per_rollout": top_row["pss_mb_per_rollout"], "idle_rss_mb": idle.rss_mb, "idle_pss_mb": idle.pss_mb,
        "levels_detail": [{k: v for k, v in r.items()} for r in rows],
    }
    print_table(f"Rollouts held in flight on one node ({args.backend} sandboxes, {workers} workers, scripted "
                f"reference policy; idle node {idle.rss_mb:.0f} MB RSS, {idle.pss_mb:.0f} MB PSS)",
                ["in flight", "held (run stage / flock / exact)", "ramp s", "drain s", "settle s", "lost", "RSS MB/rollout",
                 "PSS MB/rollout", "processes", "fds", "daemon CPU ms/rollout"],
                [[r["n"], f"{r['held_run_stage']} / {r['held_flock']} / {r['in_flight_exact']}", r["ramp_s"],
                  r["drain_s"], r["settle_s"], r["lost"], r["rss_mb_per_rollout"], r["pss_mb_per_rollout"], r["peak_processes"],
                  r["peak_fds"], r["daemon_cpu_ms_per_rollout"]] for r in rows])
    write_json(args.json, results)
    if args.plot:
        plot(rows, args.plot, args.backend)
    want = top  # every rollout of the largest level at once (1,000 unless --levels says otherwise)
    ok = check_targets([
        (f"rollouts in flight {results['rollouts_in_flight_max']} >= {want}", results["rollouts_in_flight_max"] >= want),
        (f"lost {results['lost']} = 0", results["lost"] == 0),
    ])
    return 0 if ok else 1


def plot(rows: list[dict[str, Any]], path: Path, backend: str) -> None:
    n = [r["n"] for r in rows]
    plot_panels(path, f"One node, {backend} sandboxes, 2 cores", [
        Panel("rollouts in flight", "daemon CPU per rollout (ms)", {"": (n, [r["daemon_cpu_ms_per_rollout"] for r in rows])},
              log_x=True),
        Panel("rollouts in flight", "memory per rollout (MB)",
              {"RSS (shared pages counted each time)": (n, [r["rss_mb_per_rollout"] for r in rows]),
               "PSS (shared pages split)": (n, [r["pss_mb_per_rollout"] for r in rows])}, log_x=True),
        Panel("rollouts in flight", "seconds until all are in flight", {"": (n, [r["ramp_s"] for r in rows])},
              log_x=True),
    ])

if __name__ == "__main__":
    sys.exit(main())
