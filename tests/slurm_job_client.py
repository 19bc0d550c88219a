"""Run inside Slurm jobs by tests/test_slurm.py, as the job's user: use the node daemon the
prolog started (found through ROLLOUTD_ADDRESS, set by the TaskProlog) and print one JSON line
with what was seen; the tests make the assertions."""

from __future__ import annotations

import json
import os
import sys
import urllib.request

from rolloutd.client.sync_client import RolloutClient


def main() -> None:
    command = sys.argv[1] if len(sys.argv) > 1 else "echo hi; id -u"
    with RolloutClient() as client:
        status = client.status()
        with client.open_sandbox(ipython=False) as sb:
            result = sb.run(command)
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
    }), flush=True)


if __name__ == "__main__":
    main()
