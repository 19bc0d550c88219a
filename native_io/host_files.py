"""The daemon's own files in folders a sandbox can write too (its run folder, its command folder).

The sandbox's processes run as the user that owns those folders, so they can replace any entry
in them with a symbolic link to a host file, or a FIFO. The daemon writing there by path would
then write through the link with its own rights: a command file reopened after an interrupt, or
a kernel's connection file or log written on a later start, would overwrite a host file with
text the sandbox chose. So these files are always created afresh (whatever the sandbox left at
the name is removed first, then ``O_CREAT | O_EXCL | O_NOFOLLOW``), relative to a descriptor of
their folder opened without following a link; reads take regular files only, without blocking.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from .errors import SandboxPathRefused

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CREATE_TRIES = 3
"""A sandbox racing to put its entry back between the removal and the creation wins this often."""


def open_folder(path: Path) -> int:
    """A descriptor of the folder ``path`` (its last component must not be a link)."""
    try:
        return os.open(path, DIR_FLAGS)
    except OSError as e:
        raise SandboxPathRefused(f"{path} cannot be opened as a folder ({e.strerror}): a sandbox may have "
                                 "replaced it with a link") from None


def create(folder: int, name: str, flags: int = os.O_RDWR, mode: int = 0o600) -> int:
    """A new, empty regular file ``name`` in the folder descriptor ``folder``, opened with ``flags``."""
    for _ in range(_CREATE_TRIES):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=folder)
        try:
            return os.open(name, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=folder)
        except FileExistsError:
            continue
        except IsADirectoryError:  # unlink refuses folders: the sandbox put one at the name
            raise SandboxPathRefused(f"a folder stands where the daemon writes {name!r}") from None
    raise SandboxPathRefused(f"something keeps reappearing where the daemon writes {name!r}")


def create_in(folder: Path, name: str, flags: int = os.O_WRONLY, mode: int = 0o600) -> int:
    """:func:`create` in the folder ``folder``."""
    dir_fd = open_folder(folder)
    try:
        return create(dir_fd, name, flags, mode)
    finally:
        os.close(dir_fd)


def write_new(folder: Path, name: str, data: bytes, mode: int = 0o600) -> None:
    """``folder/name`` replaced by a new file holding ``data``."""
    with open(create_in(folder, name, mode=mode), "wb") as f:
        f.write(data)


def open_regular(name: str, flags: int, *, dir_fd: int, mode: int = 0o644) -> int:
    """``name`` in the folder ``dir_fd``, opened with ``flags`` when it is a regular file reached
    without a final link; FileNotFoundError when missing, SandboxPathRefused for anything else (a
    link, a FIFO, a folder)."""
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise SandboxPathRefused(f"{name}: {e.strerror}; it is a symbolic link or not what it should be, and the "
                                 "daemon does not follow links a sandbox made") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise SandboxPathRefused(f"{name} is not a regular file")
    os.set_blocking(fd, True)
    return fd


def read_tail(folder: Path, name: str, max_bytes: int) -> bytes:
    """The last ``max_bytes`` of the regular file ``folder/name`` (b"" when it is missing or refused)."""
    try:
        dir_fd = open_folder(folder)
        try:
            fd = open_regular(name, os.O_RDONLY, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)
    except (FileNotFoundError, SandboxPathRefused):
        return b""
    with open(fd, "rb") as f:
        f.seek(max(0, os.fstat(fd).st_size - max_bytes))
        return f.read(max_bytes)
