"""Run by tests/test_sandbox_ns_join.py, as root or as an ordinary user: what a shell started by
joining an instance's namespaces sees, next to one started by ``apptainer exec``."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from rolloutd.daemon.sandbox.apptainer import ApptainerBackend
from rolloutd.daemon.sandbox.base import SandboxSpec
from rolloutd.daemon.sandbox.lease import open_lease

NAMESPACES = ("mnt", "pid", "user", "net", "ipc")
PROBE = ("pwd; id -u; id -g; grep -E '^(NoNewPrivs|CapEff):' /proc/self/status; "
         + "; ".join(f"readlink /proc/self/ns/{n} /proc/1/ns/{n}" for n in NAMESPACES)
         + "; env | cut -d= -f1 | grep -v '^_$' | sort | tr '\\n' ' '")


async def facts(exec_via: str, state: Path) -> dict[str, Any]:
    backend = ApptainerBackend(state / exec_via, uncontained_root_ok=True, exec_via=exec_via)  # type: ignore[arg-type]
    lease = await open_lease(backend.create(SandboxSpec(ipython=False)))
    try:
        lines = (await lease.run(PROBE)).output.splitlines()
        links = lines[5:5 + 2 * len(NAMESPACES)]
        # A symlink the sandbox plants must resolve inside it: as the working folder of a process
        # started there, it must not become the host's root.
        await lease.run("ln -s / /workspace/to-root")
        host_marker = state / f"host-marker-{exec_via}"
        host_marker.write_text("host")
        escape = await asyncio.create_subprocess_exec(
            *lease.sandbox.exec_argv(["sh", "-c", "ls -a; cd ../../..; ls -a"], cwd="/workspace/to-root"),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        listing, _ = await escape.communicate()
        return {
            "joined": lease.sandbox._join is not None,  # noqa: SLF001 (which path started the shell)
            "cwd": lines[0], "uid": int(lines[1]), "gid": int(lines[2]), "own_uid": os.getuid(),
            **{("no_new_privs" if key == "NoNewPrivs:" else "cap_eff"): value
               for key, value in (line.split() for line in lines[3:5])},
            "same_namespaces_as_init": {n: links[2 * i] == links[2 * i + 1] for i, n in enumerate(NAMESPACES)},
            "env_names": lines[-1].split(),
            "symlinked_cwd_listing": listing.decode().split(),
            "host_marker": host_marker.name,
        }
    finally:
        await lease.destroy()


async def main() -> dict[str, Any]:
    state = Path(tempfile.mkdtemp(prefix="rld-nsj-"))
    return {via: await facts(via, state) for via in ("nsenter", "apptainer")}


if __name__ == "__main__":
    os.chdir("/tmp")
    print(json.dumps(asyncio.run(main())))
    sys.exit(0)
