"""Run by tests/test_sandbox_caps.py, as root or as an ordinary user: sandboxes going over their caps.

``python caps_smoke.py BACKEND`` leases sandboxes of one warm pool: one allocates past its memory
cap, one writes past its workspace cap, one writes one file larger than that cap, one (apptainer:
a /dev/shm of its own) fills /dev/shm past its memory cap, one (apptainer: a hard workspace cap)
asks for room past the workspace cap and is refused, and a bystander. Prints one JSON object
with what it saw; the test makes the assertions.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from rolloutd.daemon.sandbox.base import SandboxLimits, SandboxSpec
from rolloutd.daemon.sandbox.lease import Lease
from rolloutd.daemon.sandbox.pool import WarmPool
from rolloutd.daemon.sandbox.apptainer import ApptainerBackend
from rolloutd.daemon.sandbox.local import LocalBackend
from rolloutd.native_io.errors import SandboxLimit

MEMORY_MB = 128
WORKSPACE_MB = 32
WAIT_S = 60.0
"""How long a sandbox over a cap may take to be ended (the watchdog runs every 0.2 s here)."""

# The sandbox commands hold what they took (memory, files) for WAIT_S, so that the cap's end comes
# from the watchdog while they still hold it; the test waits on the SandboxLimit, not on the time.
ALLOCATE = f"python3 -c \"x = b'x' * ({4 * MEMORY_MB} << 20); import time; time.sleep({WAIT_S})\"; sleep {WAIT_S}"
FILL = f"for i in $(seq 16); do head -c 8M /dev/zero > f$i || break; done; sleep {WAIT_S}"
FILL_SHM = f"for i in $(seq 8); do head -c {WORKSPACE_MB - 2}M /dev/zero > /dev/shm/f$i; done; sleep {WAIT_S}"
"""Files under RLIMIT_FSIZE (``workspace_mb``), past the memory cap together."""

def one_big_file(folder: str) -> str:
    return f"head -c {2 * WORKSPACE_MB}M /dev/zero > {folder}/big; echo \"exit $?\"; stat -c %s {folder}/big"


HALF = WORKSPACE_MB // 2 + 4
ENOSPC = (f"head -c {HALF}M /dev/zero > a; head -c {HALF}M /dev/zero > b; echo \"exit $?\"; "
          "du -sk . | cut -f1; df -k --output=fstype,size . | tail -1")
"""Past the workspace cap by 8 MiB in two files (each under RLIMIT_FSIZE). Run where no watchdog
looks: the full workspace would end the sandbox before its output comes back."""


async def ended_by(lease: Lease, command: str) -> dict[str, object]:
    """What ending ``command`` in ``lease`` looked like: the cap named, and how long it took."""
    started = time.monotonic()
    try:
        result = await lease.run(command, timeout_s=WAIT_S + 30)
        return {"error": None, "output": result.output, "exit_code": result.exit_code,
                "seconds": round(time.monotonic() - started, 2)}
    except SandboxLimit as e:
        return {"error": "SANDBOX_LIMIT", "cap": lease.lost_limit, "message": str(e),
                "seconds": round(time.monotonic() - started, 2)}


async def main(backend_name: str) -> dict[str, object]:
    state = Path(tempfile.mkdtemp(prefix="rld-caps-"))
    backend = (ApptainerBackend(state, uncontained_root_ok=True) if backend_name == "apptainer"
               else LocalBackend(state))
    spec = SandboxSpec(ipython=False, limits=SandboxLimits(memory_mb=MEMORY_MB, workspace_mb=WORKSPACE_MB))
    pool = WarmPool(backend, warm_specs={}, watchdog_interval_s=0.2, disk_check_interval_s=0.2)
    await pool.start()
    try:
        memory, disk, big, bystander = [await pool.lease(spec) for _ in range(4)]
        cgroup = memory.sandbox.cgroup
        seen = {
            "cgroup": str(cgroup.path) if cgroup else None,
            "memory": await ended_by(memory, ALLOCATE),
            "workspace": await ended_by(disk, FILL),
            # Apptainer's /workspace is capped by its size; /tmp is where RLIMIT_FSIZE still counts.
            "one_big_file": (await big.run(one_big_file("/tmp" if backend_name == "apptainer" else "."))).output.split(),
            "bystander": (await bystander.run("echo unaffected")).output,
        }
        leases = {"memory": memory, "workspace": disk, "one_big_file": big, "bystander": bystander}
        if backend_name == "apptainer":
            leases["shm"] = await pool.lease(spec)
            seen["shm"] = await ended_by(leases["shm"], FILL_SHM)
            unwatched = WarmPool(backend, warm_specs={}, watchdog_interval_s=3600)
            await unwatched.start()
            try:
                seen["enospc"] = (await (await unwatched.lease(spec)).run(ENOSPC)).output
            finally:
                await unwatched.close()
        seen["caps_passed"] = {name: lease.lost_limit for name, lease in leases.items()}
        seen["watchdog_kills"] = pool.counters["watchdog_kills"]
    finally:
        await pool.close()
    seen["cgroup_left"] = cgroup is not None and cgroup.path.exists()
    seen["state_left"] = sorted(p.name for p in state.iterdir() if p.name not in ("shared", "apptainer"))
    return seen


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1]))))
