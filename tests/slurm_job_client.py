"""Run inside Slurm jobs by tests/test_slurm.py, as the job's user: use the node daemon the
prolog started (found through ROLLOUTD_ADDRESS, set by the TaskProlog) and print one JSON line
with what was seen; the tests make the assertions. With ROLLOUTD_TEST_ROLLOUT_TASK set, it also
rolls out that bundled task once through the daemon (its inference servers as the job set them)."""

from __future__ import annotations

import json
import os
import sys
import urllib.request

from rolloutd.client.async_client import RolloutRequest
from rolloutd.client.sync_client import RolloutClient


def main() -> None:
    command = sys.argv[1] if len(sys.argv) > 1 else "echo hi; id -u"
    with RolloutClient() as client:
        status = client.status()
        with client.open_sandbox(ipython=False) as sb:
            result = sb.run(command)
        rollout = None
        if task := os.environ.get("ROLLOUTD_TEST_ROLLOUT_TASK"):
            # seed: the scripted reference policy varies samples by it
            done = client.results(client.submit([RolloutRequest(task_id=task, n=1, sampling={"seed": 1})]),
                                  timeout_s=300)
            (res,) = done.values()
            if res.error is not None:
                rollout = {"error": f"{res.error.code}: {res.error}"}
            else:
                t = res.trajectories[0]
                rollout = {"task": t.task_id, "reward": t.reward, "ended_by": t.ended_by, "turns": t.num_turns}
    servers = [u for u in os.environ.get("ROLLOUTD_INFERENCE_SERVERS", "").split(",") if u]
    health = [urllib.request.urlopen(f"{u}/health", timeout=10).status for u in servers]
    pid = status["pid"]
    with open(f"/proc/{pid}/status") as f:
        daemon_uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
    print(json.dumps({
        "address": os.environ.get("ROLLOUTD_ADDRESS"),
        "daemon_pid": pid,
        "daemon_uid": daemon_uid,
        "daemon_sid": os.getsid(pid),
        "uid": os.getuid(),
        "job": os.environ.get("SLURM_JOB_ID"),
        "task": os.environ.get("SLURM_PROCID"),
        "output": result.output,
        "exit_code": result.exit_code,
        "inference_health": health,
        "rollout": rollout,
    }), flush=True)


if __name__ == "__main__":
    main()
