"""Rollouts for a fixed time: does the node daemon's memory or descriptor count grow?

The scripted reference policy and a node daemon (Apptainer, 2 workers) run bundled-task
rollouts, 8 in flight, for ``--seconds`` (30 with ``--quick``). After a warm-up batch (pools,
caches and arenas reach their working size), the resident memory and the open descriptors of the
supervisor and its workers are read; again at the end. Reported: ``rss_growth_mb``,
``fd_growth``, ``rollouts``, ``errors`` (trajectories that ended in an error). Targets: growth
<= 20 MB and <= 10 descriptors over the run.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import check_targets, print_table, standard_args, write_json  # noqa: E402
from node_stack import CLI, Policy, start_node  # noqa: E402

from rolloutd.client.async_client import RolloutRequest  # noqa: E402
from rolloutd.client.sync_client import RolloutClient  # noqa: E402
from rolloutd.daemon.tasks.datasets import oracle_plans  # noqa: E402

IN_FLIGHT = 8


def footprint(client: RolloutClient) -> tuple[float, int]:
    """(resident MB, open descriptors) of the supervisor and its workers."""
    st = client.status()
    procs = [psutil.Process(pid) for pid in [st["pid"], *(w["pid"] for w in st["workers"])]]
    return sum(p.memory_info().rss for p in procs) / 2**20, sum(p.num_fds() for p in procs)


def run_for(client: RolloutClient, seconds: float, tasks: list[str], max_turns: int) -> tuple[int, int]:
    """Rollouts kept at IN_FLIGHT until ``seconds`` pass; (finished, errors)."""
    def request(i: int) -> RolloutRequest:
        return RolloutRequest(task_id=tasks[i % len(tasks)], sampling={"max_tokens": 1024},
                              agent_config={"max_turns": max_turns})

    end, submitted, done, errors = time.monotonic() + seconds, 0, 0, 0
    pending = set(client.submit([request(i) for i in range(IN_FLIGHT)]))
    submitted = IN_FLIGHT
    while pending:
        result = next(iter(client.as_completed(list(pending), timeout_s=600)))
        pending.discard(result.request_id)
        done += 1
        errors += result.error is not None or any(t.finish_reason == "error" for t in result.trajectories)
        client.release(result)
        if time.monotonic() < end:
            pending.update(client.submit([request(submitted)]))
            submitted += 1
    return done, errors


def main() -> int:
    p = standard_args(__doc__.splitlines()[0])
    p.add_argument("--seconds", type=float, default=300.0)
    args = p.parse_args()
    seconds = 30.0 if args.quick else args.seconds
    work = Path(tempfile.mkdtemp(prefix="rld-soak-"))
    plans = oracle_plans()
    (work / "plans.json").write_text(json.dumps({"plans": plans}))
    tasks, max_turns = sorted(plans), max(map(len, plans.values()))
    api_key = secrets.token_hex(16)
    policy = Policy(work / "plans.json", api_key)
    policy.start()
    try:
        address = start_node(work / "node", policy.url, {"ROLLOUTD_INFERENCE_API_KEY": api_key})
        try:
            with RolloutClient(address) as client:
                run_for(client, 0.0, tasks, max_turns)  # warm-up: one batch of IN_FLIGHT
                rss0, fds0 = footprint(client)
                rollouts, errors = run_for(client, seconds, tasks, max_turns)
                rss1, fds1 = footprint(client)
        finally:
            subprocess.run([*CLI, "stop", "--run-dir", str(work / "node")], capture_output=True, timeout=120)
    finally:
        policy.stop()
    results = {"seconds": seconds, "rollouts": rollouts, "errors": errors, "rss_start_mb": round(rss0, 1),
               "rss_growth_mb": round(rss1 - rss0, 1), "fds_start": fds0, "fd_growth": fds1 - fds0}
    print_table(f"Soak: {seconds:.0f} s of rollouts, {IN_FLIGHT} in flight", ["figure", "value"],
                sorted(results.items()))
    write_json(args.json, results)
    ok = check_targets([("rss growth <= 20 MB", results["rss_growth_mb"] <= 20),
                        ("fd growth <= 10", results["fd_growth"] <= 10),
                        ("no errors", errors == 0)])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
