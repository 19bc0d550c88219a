"""Moving files into and out of a sandbox.

What the sandbox can read itself (its backend's shared folder) it copies with its own shell;
under the sandbox's workspace the host writes directly (the folder is bound into the container);
anywhere else (a repository baked into the image, e.g. /testbed) files go through the shell as
base64, which works for any image with coreutils.
"""

from __future__ import annotations

import asyncio
import base64
import shlex
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from rolloutd.native_io.errors import SandboxError
from rolloutd.native_io.output import tail

if TYPE_CHECKING:
    from ..sandbox.pool import Lease

IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
COPY_TIMEOUT_S = 300.0
"""A task's repository copied by the sandbox's shell."""
WRITE_TIMEOUT_S = 60.0
"""One file written or read through the sandbox's shell (base64 through the PTY)."""


def host_path(lease: "Lease", inside: str) -> Path | None:
    """The host path of ``inside`` when it lies in the bound workspace, else None."""
    root = lease.sandbox.workspace_inside.rstrip("/")
    if inside == root or inside.startswith(root + "/"):
        return lease.sandbox.workspace / inside[len(root):].lstrip("/")
    return None


async def copy_tree_in(lease: "Lease", source: Path, inside: str) -> None:
    """Copy the host folder ``source`` to ``inside`` (merged into what is there).

    A folder the sandbox can read (its backend's shared folder: task templates) is copied by the
    sandbox's own shell, which costs the daemon one command instead of a syscall per file."""
    seen = lease.sandbox.visible_path(source)
    if seen is not None:
        r = await lease.run(f"mkdir -p {shlex.quote(inside)} && cp -R --preserve=mode,timestamps,links "
                            f"{shlex.quote(seen)}/. {shlex.quote(inside)}", timeout_s=COPY_TIMEOUT_S)
        if r.exit_code != 0:
            raise SandboxError(f"cannot copy {source} into {inside} in sandbox {lease.id}: {tail(r.output)}")
        return
    target = host_path(lease, inside)
    if target is not None:
        await asyncio.to_thread(shutil.copytree, source, target, ignore=IGNORED, dirs_exist_ok=True, symlinks=True)
        return
    files = await asyncio.to_thread(
        lambda: [p for p in sorted(source.rglob("*")) if p.is_file() and "__pycache__" not in p.parts])
    for path in files:
        await write_file(lease, f"{inside}/{path.relative_to(source).as_posix()}", await asyncio.to_thread(path.read_bytes))


async def write_file(lease: "Lease", inside: str, data: bytes) -> None:
    target = host_path(lease, inside)
    if target is not None:
        def write() -> None:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)

        await asyncio.to_thread(write)
        return
    encoded = base64.b64encode(data).decode()
    quoted = shlex.quote(inside)
    r = await lease.run(f"mkdir -p \"$(dirname {quoted})\" && base64 -d > {quoted} <<'RLD_EOF'\n{encoded}\nRLD_EOF",
                        timeout_s=WRITE_TIMEOUT_S)
    if r.exit_code != 0:
        raise SandboxError(f"cannot write {inside} in sandbox {lease.id}: {tail(r.output)}")


async def read_file(lease: "Lease", inside: str, *, max_bytes: int) -> bytes | None:
    """The bytes of ``inside``, or None when there is no such file; more than ``max_bytes`` is an
    error (the file may come from code the agent wrote)."""
    target = host_path(lease, inside)
    if target is not None:
        def read() -> bytes | None:
            try:
                with open(target, "rb") as f:
                    data = f.read(max_bytes + 1)
            except FileNotFoundError:
                return None
            return data

        data = await asyncio.to_thread(read)
    else:
        quoted = shlex.quote(inside)
        r = await lease.run(f"test -f {quoted} || exit 3; head -c {max_bytes + 1} {quoted} | base64 -w0",
                            timeout_s=WRITE_TIMEOUT_S)
        if r.exit_code == 3:
            return None
        if r.exit_code != 0:
            raise SandboxError(f"cannot read {inside} in sandbox {lease.id}: {tail(r.output)}")
        data = base64.b64decode(r.output.strip())
    if data is not None and len(data) > max_bytes:
        raise SandboxError(f"{inside} in sandbox {lease.id} is over {max_bytes} bytes")
    return data
