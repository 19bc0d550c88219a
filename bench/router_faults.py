"""Router faults (issue 30), part of ``bench/faults.py``: a batch through a router and two node
daemons (local sandboxes) while, in turn, the router is killed with SIGKILL and started again, a
node is stopped (SIGSTOP) past the heartbeat timeout, a second node registers under a live node's
name, and the trainer reconnects mid-batch.

Each request is a real rollout (script agent, inline command task) whose last command appends
its id to a log once it ran to its end, so runs are counted outside the daemons. A bare DEALER
sends and counts every answer (the client library would hide a duplicate); after the router
restart, and after its reconnect, it asks again for the ids it has no answer for, under the same
client name. Reported per case: ``requests``, ``answered_once``, ``lost`` (no answer),
``duplicated`` (more than one), ``errors`` (an error answer), ``runs_per_request_max`` (target 1: a run on a stalled node is
cancelled, and work finished while the router was down is collected, not run again).
"""

from __future__ import annotations

import collections
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("ROLLOUTD_CACHE_DIR", str(Path(__file__).resolve().parent.parent / ".cache"))  # as the tests
from daemon_fixtures import start_router  # noqa: E402
from router_support import (  # noqa: E402
    FAST_HEARTBEATS,
    NODE_ARGS,
    Federation,
    RawTrainer,
    counted_rollout,
    federation,
    run_log,
)
from support.waits import wait_until  # noqa: E402

from rolloutd.native_io.wire import MsgType  # noqa: E402

ANSWER_TIMEOUT_S = 120.0
"""A batch of a few seconds' rollouts is answered well within this, faults included."""
CLIENT = "bench-trainer"


def _figures(ids: list[str], answers: dict[str, list[Any]], log: Path) -> dict[str, int]:
    runs = collections.Counter(log.read_text().split())
    return {
        "requests": len(ids),
        "answered_once": sum(len(answers.get(r, [])) == 1 for r in ids),
        "lost": sum(r not in answers for r in ids),
        "duplicated": sum(len(answers.get(r, [])) > 1 for r in ids),
        "runs_per_request_max": max((runs[r] for r in ids), default=0),
        "errors": sum(any(kind == MsgType.ERROR for kind, _, _ in answers.get(r, [])) for r in ids),
    }


def _batch(fed: Federation, log: Path, n: int, seconds: float, fault: Callable[[RawTrainer, list[str]], RawTrainer],
           prefix: str) -> dict[str, int]:
    """Send ``n`` rollouts, let ``fault`` act (it returns the trainer that collects), collect."""
    ids = [f"{prefix}{i}" for i in range(n)]
    trainer = RawTrainer(fed.address, client=CLIENT)
    for rid in ids:
        trainer.send(rid, "rollout", counted_rollout(log, rid, seconds))
    collector = fault(trainer, ids)
    try:
        try:
            collector.collect(ids, timeout_s=ANSWER_TIMEOUT_S, linger_s=2.0)
        except AssertionError as e:
            print(" -", e)
        answers = collector.answers
    finally:
        collector.close()
    return _figures(ids, answers, log)


def _in_flight(fed: Federation, n: int) -> None:
    wait_until(lambda: sum(x["in_flight"] for x in fed.status()["nodes"]) >= n, 60, f"{n} rollouts on the nodes")


def router_killed(work: Path, n: int) -> dict[str, int]:
    log = run_log(work)

    def fault(trainer: RawTrainer, ids: list[str]) -> RawTrainer:
        _in_flight(fed, 4)
        os.kill(int((fed.router_dir / "router.pid").read_text()), signal.SIGKILL)
        start_router(fed.router_dir, *FAST_HEARTBEATS)
        fed.wait_nodes(2)
        trainer.collect([], timeout_s=5, linger_s=0.5)  # whatever the old router sent before it died
        for rid in ids:  # the unanswered ids again (a real trainer sees DAEMON_LOST for them)
            if rid not in trainer.answers:
                trainer.send(rid, "rollout", counted_rollout(log, rid, 2.0))
        return trainer

    with federation(work, 2) as fed:
        return _batch(fed, log, n, 2.0, fault, "rk")


def node_stalled(work: Path, n: int) -> dict[str, int]:
    log = run_log(work)

    def fault(trainer: RawTrainer, ids: list[str]) -> RawTrainer:
        _in_flight(fed, 4)
        stalled = fed.node_pid(0)
        os.kill(stalled, signal.SIGSTOP)
        try:
            wait_until(lambda: fed.status()["counters"]["node_lost"] >= 1, 30, "the stalled node dropped")
        finally:
            os.kill(stalled, signal.SIGCONT)
        return trainer

    with federation(work, 2) as fed:
        return _batch(fed, log, n, 4.0, fault, "ns")


def duplicate_name(work: Path, n: int) -> dict[str, int]:
    log = run_log(work)
    twin = (*NODE_ARGS, "--node-name", "twin")
    with federation(work, 1, node_args=twin) as fed:
        fed.node_dirs.append(work / "twin2")
        fed.start([1])  # the same name, another folder: refused while the first lives

        def fault(trainer: RawTrainer, ids: list[str]) -> RawTrainer:
            wait_until(lambda: fed.status()["counters"]["names_refused"] >= 1, 30, "the second twin refused")
            return trainer

        figures = _batch(fed, log, n, 0.5, fault, "dn")
        counters = fed.status()["counters"]
    return {**figures, "names_refused": counters["names_refused"], "evictions": counters["node_lost"]}


def client_reconnects(work: Path, n: int) -> dict[str, int]:
    log = run_log(work)

    def fault(trainer: RawTrainer, ids: list[str]) -> RawTrainer:
        wait_until(lambda: fed.status()["in_flight"] >= n, 60, "the batch at the router")
        trainer.collect([], timeout_s=5, linger_s=0.3)
        trainer.close()  # gone while its answers come; back as a new connection, same client name
        wait_until(lambda: len(log.read_text().split()) >= n // 2, 60, "half the batch finished")
        back = RawTrainer(fed.address, client=CLIENT)
        back.answers.update(trainer.answers)
        for rid in ids:  # what it has no answer for: finished (kept for it), running or waiting (joined)
            if rid not in back.answers:
                back.send(rid, "rollout", counted_rollout(log, rid, 1.5))
        return back

    with federation(work, 2) as fed:
        return _batch(fed, log, n, 1.5, fault, "cr")


CASES: dict[str, Callable[[Path, int], dict[str, int]]] = {
    "router kill -9 + restart": router_killed,
    "node SIGSTOP past heartbeat": node_stalled,
    "duplicate node name": duplicate_name,
    "client reconnects mid-batch": client_reconnects,
}


def run_all(quick: bool) -> tuple[dict[str, dict[str, int]], list[tuple[str, bool]]]:
    """Every case's figures, and the targets they must meet."""
    n = 6 if quick else 16
    results: dict[str, dict[str, int]] = {}
    for name, case in CASES.items():
        work = Path(tempfile.mkdtemp(prefix="rld-"))
        work.chmod(0o700)
        started = time.monotonic()
        try:
            results[name] = case(work, n)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(f" - {name}: {time.monotonic() - started:.1f} s")
    targets = [(f"{name}: answered_once = requests, lost = duplicated = errors = 0, runs_per_request_max = 1",
                r["answered_once"] == r["requests"] and r["lost"] == r["duplicated"] == r["errors"] == 0
                and r["runs_per_request_max"] == 1) for name, r in results.items()]
    targets.append(("duplicate node name: refused, no eviction",
                    results["duplicate node name"]["names_refused"] >= 1
                    and results["duplicate node name"]["evictions"] == 0))
    return results, targets
