"""Moving files into and out of a sandbox.

What the sandbox can read itself (its backend's shared folder) it copies with its own shell;
under the sandbox's workspace the host writes directly (the folder is bound into the container);
anywhere else (a repository baked into the image, e.g. /testbed) files go through the shell as
base64, which works for any image with coreutils.

The host's reads and writes in the workspace walk it one folder at a time from a descriptor of
the workspace, refusing every symbolic link (``O_NOFOLLOW``) and anything but a regular file
(``SandboxPathRefused``). The sandbox owns those folders: a link it planted where the evaluation's
files go (``tests -> /home/user``) would otherwise be followed on the host, with the daemon's
rights, and an absolute link resolves against the host's root even through ``/proc/PID/root``.
A FIFO planted where a report is read would block the reading thread for good.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import shlex
import shutil
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from rolloutd.native_io.errors import SandboxError, SandboxPathRefused
from rolloutd.native_io.host_files import DIR_FLAGS, open_regular
from rolloutd.native_io.output import tail

if TYPE_CHECKING:
    from ..sandbox.lease import Lease

IGNORED = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache")
COPY_TIMEOUT_S = 300.0
"""A task's repository copied by the sandbox's shell."""
WRITE_TIMEOUT_S = 60.0
"""One file written or read through the sandbox's shell (base64 through the PTY)."""


def in_workspace(lease: "Lease", inside: str) -> str | None:
    """``inside`` relative to the sandbox's workspace when it lies there, else None."""
    root = lease.sandbox.workspace_inside.rstrip("/")
    if inside == root or inside.startswith(root + "/"):
        return inside[len(root):].lstrip("/")
    return None


def _open_beneath(lease: "Lease", rel: str, flags: int, *, make_folders: bool) -> int:
    """A descriptor of the regular file ``rel`` under the workspace, reached without following a
    link (see the module's note); ``make_folders`` makes the missing folders on the way."""
    parts = rel.split("/")
    if not rel or any(p in ("", ".", "..") for p in parts):
        raise SandboxPathRefused(f"{rel!r} is not a plain path under the workspace of sandbox {lease.id}")
    where = f"{lease.sandbox.workspace_inside}/{rel} in sandbox {lease.id}"
    try:
        folder = os.open(lease.sandbox.workspace, DIR_FLAGS)
        try:
            for part in parts[:-1]:
                if make_folders:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(part, 0o755, dir_fd=folder)
                inner = os.open(part, DIR_FLAGS, dir_fd=folder)
                os.close(folder)
                folder = inner
            return open_regular(parts[-1], flags, dir_fd=folder)
        finally:
            os.close(folder)
    except SandboxPathRefused as e:
        raise SandboxPathRefused(f"{where}: {e}") from None
    except FileNotFoundError:
        raise
    except OSError as e:
        raise SandboxPathRefused(f"{where}: {e.strerror} on the way; a folder is a symbolic link or not a folder, "
                                 "and the daemon does not follow links the sandbox made") from None


def _write_beneath(lease: "Lease", rel: str, data: bytes, mode: int | None = None) -> None:
    fd = _open_beneath(lease, rel, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, make_folders=True)
    with open(fd, "wb") as f:
        f.write(data)
        if mode is not None:
            os.fchmod(f.fileno(), mode)


def _copy_beneath(lease: "Lease", source: Path, rel: str) -> None:
    """The host folder ``source`` (trusted) merged into ``rel`` under the workspace."""
    for folder, dirs, files in os.walk(source):
        dirs[:] = [d for d in dirs if not IGNORED(folder, [d])]
        skipped = IGNORED(folder, files)
        for name in files:
            if name not in skipped:
                path = os.path.join(folder, name)
                target = os.path.relpath(path, source)
                with open(path, "rb") as f:
                    _write_beneath(lease, f"{rel}/{target}" if rel else target, f.read(),
                                   stat.S_IMODE(os.fstat(f.fileno()).st_mode))


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
    rel = in_workspace(lease, inside)
    if rel is not None:
        await asyncio.to_thread(_copy_beneath, lease, source, rel)
        return
    files = await asyncio.to_thread(
        lambda: [p for p in sorted(source.rglob("*")) if p.is_file() and "__pycache__" not in p.parts])
    for path in files:
        await write_file(lease, f"{inside}/{path.relative_to(source).as_posix()}", await asyncio.to_thread(path.read_bytes))


async def write_file(lease: "Lease", inside: str, data: bytes) -> None:
    rel = in_workspace(lease, inside)
    if rel is not None:
        await asyncio.to_thread(_write_beneath, lease, rel, data)
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
    rel = in_workspace(lease, inside)
    if rel is not None:
        def read() -> bytes | None:
            try:
                fd = _open_beneath(lease, rel, os.O_RDONLY, make_folders=False)
            except FileNotFoundError:
                return None
            with open(fd, "rb") as f:
                return f.read(max_bytes + 1)

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
