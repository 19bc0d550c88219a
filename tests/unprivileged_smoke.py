"""Run by tests/test_unprivileged.py as an ordinary user: one real sandbox and a task set up in it.

Prints one JSON object with what it saw; the test makes the assertions.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path

from rolloutd.daemon.sandbox.apptainer import ApptainerBackend
from rolloutd.daemon.sandbox.base import SandboxSpec
from rolloutd.daemon.sandbox.pool import WarmPool
from rolloutd.daemon.tasks.base import get_task_type
from rolloutd.daemon.tasks.datasets import resolve_task

from privilege_probe import PROBE
from proc_support import identities, still_running


async def main() -> dict[str, object]:
    state = Path(tempfile.mkdtemp(prefix="rld-u-"))
    backend = ApptainerBackend(state)
    spec = SandboxSpec(ipython=True)
    pool = WarmPool(backend, warm_specs={spec: 1})
    await pool.start()
    await pool.wait_ready(120)
    lease = await pool.lease(spec)
    shell = await lease.run("id -u; touch /usr/forbidden 2>&1; echo ws > /workspace/f && cat /workspace/f")
    kernel = await lease.ipython("import os\nos.getuid()")
    privileges = await lease.run(PROBE)
    # A task repository copied in by the sandbox itself from the read-only shared folder.
    task = resolve_task("bundled", "wordwrap-001", None)
    await get_task_type("swe").setup(task, lease, cache_dir=backend.shared_dir / "task-cache")
    repo = await lease.run(f"git log --oneline | wc -l; git status --porcelain | wc -l; "
                           f"touch {lease.sandbox.shared_inside}/x 2>/dev/null && echo writable || echo read-only")
    seen = identities(lease.sandbox.process_ids())
    await pool.release(lease)
    await pool.close()
    alive = still_running(seen)
    out = {
        "host_uid": os.getuid(),
        "shell_output": shell.output,
        "task_repo": repo.output,
        "privileges": privileges.output,
        "kernel_uid": kernel.result,
        "leftover_instances": backend.leftover_instances(),
        "alive_after_close": alive,
        "state_dir_mode": oct(state.stat().st_mode & 0o777),
    }
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main())))
    sys.exit(0)
