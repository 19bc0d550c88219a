"""Faults injected into a running batch: every accepted request answered exactly once, nothing left.

One node daemon (Apptainer sandboxes, 2 workers) and the scripted reference policy server run a
batch of bundled-task rollouts sent by a bare DEALER (the client library would hide a duplicate
answer). While it runs, in turn: a worker is killed with SIGKILL, a sandbox's init is killed,
the inference server is killed and started again on the same port, one rollout's command
asks for 20 GiB of memory and one writes past its workspace cap (a full disk). Then a second
batch loses its supervisor to SIGKILL: the client library must fail those calls with DAEMON_LOST
(an answer, not a hang), and a new daemon on the same run folder must reap what the dead one left.
Then the router's faults (``router_faults``): kill -9 and restart of the router, a node stopped
past the heartbeat timeout, a duplicate node name, a trainer reconnecting mid-batch;
``--router-only`` runs just those (no Apptainer needed).

Reported: ``requests``, ``answered_once``, ``lost`` (no answer), ``duplicated`` (more than one),
``infra_marked`` (trajectories whose ``ended_by`` is not the model: never scored),
``leftover_processes`` (processes still using the node's folders or in its memory cgroups),
``leftover_instances`` (Apptainer instances still alive), ``leftover_shm`` (the daemons'
shared-memory segments), ``leftover_cgroups`` (a root daemon's memory cgroup folders). Not
injected here: a full run folder (``tests/test_pool.py`` fills a tmpfs) and kill -9 of a node
under a router (``tests/test_router.py``).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from common import check_targets, print_table, standard_args, write_json  # noqa: E402
from node_stack import CLI, Policy, start_node  # noqa: E402
from router_support import RawTrainer  # noqa: E402
import router_faults  # noqa: E402

from rolloutd.client.async_client import AsyncRolloutClient, RolloutRequest  # noqa: E402
from rolloutd.client.sync_client import RolloutClient  # noqa: E402
from rolloutd.cli.run_lock import running_pid  # noqa: E402
from rolloutd.daemon.node.config import NodeConfig  # noqa: E402
from rolloutd.daemon.node.sandbox_user import workers_dir  # noqa: E402
from rolloutd.daemon.sandbox.cgroups import DELEGATED_PREFIX, MemoryCgroups  # noqa: E402
from rolloutd.native_io.wire import MsgType  # noqa: E402
from rolloutd.daemon.tasks.datasets import oracle_plans  # noqa: E402
from rolloutd.native_io import shm  # noqa: E402
from rolloutd.native_io.errors import DaemonLost  # noqa: E402

MEMORY_HOG = "python3 -c 'x = bytearray(20 * 2**30)'; echo survived"
WORKSPACE_MB = 256
DISK_HOG = "for i in 1 2 3; do head -c 128M /dev/zero > f$i || break; done; sleep 30; echo survived"
"""Past the sandboxes' workspace cap (WORKSPACE_MB), which then holds it until the watchdog ends it."""
HOGS = {3: ("memory-hog", MEMORY_HOG), 5: ("disk-hog", DISK_HOG)}


def rollout_args(i: int, tasks: list[str], max_turns: int) -> dict[str, Any]:
    if i in HOGS:  # the memory blowup and the full disk: a command task whose one command does it
        name, command = HOGS[i]
        task = {"type": "command", "instance_id": name, "eval_script": "echo 1"}
        req = RolloutRequest(task=task, agent="script", agent_config={"commands": [command]}, ipython=False)
    else:
        req = RolloutRequest(task_id=tasks[i % len(tasks)], sampling={"max_tokens": 1024},
                             agent_config={"max_turns": max_turns})
    return req.to_args()


def instance_pids(states: Path) -> list[int]:
    pids = []
    for pidfile in states.glob("*/*/instance.pid"):
        try:
            pids.append(int(pidfile.read_text()))
        except (OSError, ValueError):
            continue
    return pids


def wait_for(what: str, condition: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.1)


def inject(address: str, states: Path, restart_policy: Any, log: list[str]) -> None:
    """The faults of the first batch, each once the batch is under way."""
    with RolloutClient(address, timeout_s=30) as client:
        workers = client.status()["workers"]
    wait_for("sandboxes in use", lambda: len(instance_pids(states)) >= 3, 120)
    os.kill(workers[0]["pid"], signal.SIGKILL)
    log.append(f"SIGKILL worker pid {workers[0]['pid']}")
    wait_for("the other worker's sandboxes", lambda: instance_pids(states), 60)
    victim = instance_pids(states)[-1]
    os.kill(victim, signal.SIGKILL)
    log.append(f"SIGKILL sandbox init pid {victim}")
    restart_policy()
    log.append("inference server killed and restarted on its port")


def leftovers(run_dir: Path, states: Path, instances: set[int], daemon_pids: list[int]) -> dict[str, int]:
    marks = (str(run_dir), str(states))
    procs = 0
    for p in psutil.process_iter(["cmdline", "cwd"]):
        text = " ".join(p.info.get("cmdline") or []) + " " + (p.info.get("cwd") or "")
        procs += any(m in text for m in marks)
    alive = sum(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in instances)
    segments = sum(len(shm.list_segments(f"rld{os.getuid()}-{pid}-")) for pid in daemon_pids)
    # A root daemon's sandboxes live in memory cgroups under this process's own (it inherits it):
    # every process of every sandbox is listed there, also those no state folder names any more.
    own = MemoryCgroups.discover() if os.getuid() == 0 else None
    tree = own.parent / f"{DELEGATED_PREFIX}{states.name}" if own else None
    folders = [tree, *(p for p in tree.rglob("*") if p.is_dir())] if tree and tree.is_dir() else []
    in_cgroups = sum(len((f / "cgroup.procs").read_text().split()) for f in folders)
    return {"leftover_processes": procs + in_cgroups, "leftover_instances": alive, "leftover_shm": segments,
            "leftover_cgroups": len(folders)}


def first_batch(address: str, n: int, tasks: list[str], max_turns: int, states: Path,
                policy: Policy) -> tuple[dict[str, Any], list[str]]:
    trainer = RawTrainer(address)
    ids = [f"fault-{i}" for i in range(n)]
    log: list[str] = []
    try:
        for i, rid in enumerate(ids):
            trainer.send(rid, "rollout", rollout_args(i, tasks, max_turns))
        inject(address, states, policy.restart, log)
        try:
            trainer.collect(ids, timeout_s=600, linger_s=2.0)
        except AssertionError as e:
            log.append(f"collect: {e}")
    finally:
        trainer.close()
    answers = trainer.answers
    infra = 0
    for rid in ids:
        for kind, header, _ in answers.get(rid, []):
            if kind == MsgType.ERROR:
                log.append(f"{rid} answered {header.get('code')}: {str(header.get('message'))[:120]}")
            if kind == MsgType.REPLY:
                for t in header["result"]["trajectories"]:
                    if t.get("ended_by", "model") != "model":
                        infra += 1
                        log.append(f"{rid} ended_by {t['ended_by']}: {t.get('error_code')}: "
                                   f"{str(t.get('error_message'))[:120]}")
    return {
        "requests": n,
        "answered_once": sum(len(answers.get(r, [])) == 1 for r in ids),
        "lost": sum(r not in answers for r in ids),
        "duplicated": sum(len(answers.get(r, [])) > 1 for r in ids),
        "infra_marked": infra,
        "errors": sum(any(k == MsgType.ERROR for k, _, _ in answers.get(r, [])) for r in ids),
    }, log


async def supervisor_killed(address: str, run_dir: Path, n: int, tasks: list[str], max_turns: int) -> dict[str, int]:
    """A batch whose supervisor is killed: every call must end in DAEMON_LOST within seconds."""
    async with AsyncRolloutClient(address) as client:
        ids = await client.submit([RolloutRequest(task_id=tasks[i % len(tasks)], sampling={"max_tokens": 1024},
                                                  agent_config={"max_turns": max_turns}) for i in range(n)])
        states = workers_dir(NodeConfig(run_dir=str(run_dir)))
        await asyncio.to_thread(wait_for, "the batch's sandboxes", lambda: len(instance_pids(states)) >= 2, 120)
        pid = running_pid(run_dir, "node")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        results = [r async for r in client.as_completed(ids, timeout_s=60)]
    return {"requests": n, "answered_once": len({r.request_id for r in results}),
            "daemon_lost": sum(isinstance(r.error, DaemonLost) for r in results),
            "completed_before": sum(r.error is None for r in results),
            "lost_within_s": round(time.monotonic() - started, 2)}


def router_part(quick: bool) -> tuple[dict[str, Any], list[tuple[str, bool]]]:
    """The router's cases, printed as one row each; their flat figures and targets."""
    cases, targets = router_faults.run_all(quick)
    columns = ["requests", "answered_once", "lost", "duplicated", "runs_per_request_max", "errors"]
    print_table("Router faults during a batch", ["case", *columns], [[name, *(r[c] for c in columns)]
                                                                      for name, r in cases.items()])
    flat = {f"router_{'_'.join(name.replace('-', ' ').replace('+', ' ').split()[:3])}_{k}": v
            for name, r in cases.items() for k, v in r.items()}
    return flat, targets


def main() -> int:
    parser = standard_args(__doc__.splitlines()[0])
    parser.add_argument("--router-only", action="store_true", help="only the router's faults (no Apptainer)")
    args = parser.parse_args()
    if args.router_only:
        flat, targets = router_part(args.quick)
        write_json(args.json, flat)
        return 0 if check_targets(targets) else 1
    n = 8 if args.quick else 24
    work = Path(tempfile.mkdtemp(prefix="rld-faults-"))
    plans = oracle_plans()
    (work / "plans.json").write_text(json.dumps({"plans": plans}))
    tasks, max_turns = sorted(plans), max(map(len, plans.values()))
    api_key = secrets.token_hex(16)
    env = {"ROLLOUTD_INFERENCE_API_KEY": api_key, "ROLLOUTD_SANDBOX_WORKSPACE_MB": str(WORKSPACE_MB)}
    run_dir = work / "node"
    states = workers_dir(NodeConfig(run_dir=str(run_dir)))
    policy = Policy(work / "plans.json", api_key)
    policy.start()
    seen_instances: set[int] = set()
    daemon_pids: list[int] = []
    try:
        address = start_node(run_dir, policy.url, env)
        daemon_pids.append(running_pid(run_dir, "node") or 0)
        batch, log = first_batch(address, n, tasks, max_turns, states, policy)
        seen_instances.update(instance_pids(states))
        killed = asyncio.run(supervisor_killed(address, run_dir, 4, tasks, max_turns))
        seen_instances.update(instance_pids(states))
        log.append("SIGKILL supervisor")
        start_node(run_dir, policy.url, env)  # reaps what the dead one left
        daemon_pids.append(running_pid(run_dir, "node") or 0)
        subprocess.run([*CLI, "stop", "--run-dir", str(run_dir)], capture_output=True, timeout=120, check=True)
    finally:
        policy.stop()
    left = leftovers(run_dir, states, seen_instances, daemon_pids)
    deadline = time.monotonic() + 10.0  # the stopped daemon's last children may still be exiting
    while any(left.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
        left = leftovers(run_dir, states, seen_instances, daemon_pids)
    results = {**{f"batch_{k}": v for k, v in batch.items()}, **{f"killed_{k}": v for k, v in killed.items()}, **left}
    for line in log:
        print(" -", line)
    print_table("Faults during a batch", ["figure", "value"], sorted(results.items()))
    router_flat, router_targets = router_part(args.quick)
    write_json(args.json, {**results, **router_flat})
    ok = check_targets([*router_targets,
        ("batch: lost = duplicated = 0, answered_once = requests",
         batch["lost"] == 0 and batch["duplicated"] == 0 and batch["answered_once"] == batch["requests"]),
        ("supervisor killed: every call answered (DAEMON_LOST or done)",
         killed["answered_once"] == killed["requests"]),
        ("no leftover process, instance, segment or cgroup", not any(left.values())),
    ])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
