"""Token arrays in POSIX shared memory, mapped by a co-located reader without a copy.

Layout of one segment (one per reply)::

    +---------+---------+-----+---------+
    | array 0 | array 1 | ... | array n |     each array starts at a 64-byte aligned offset;
    +---------+---------+-----+---------+     the header of the reply names key/dtype/shape/offset

Lifecycle: the writer (a worker) creates and fills the segment, then forgets it; the supervisor
owns its name from then on and unlinks it when the reader releases it, when the reader process
is gone past its lease, or at shutdown. A reader's mapping survives the unlink, so the memory
is freed when both happened. Segments are opened as plain files under /dev/shm, not through
``multiprocessing.shared_memory``: Python's resource tracker would otherwise unlink, at reader
exit, segments the reader does not own.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from .errors import BadRequest, NotFound
from .framing import ArrayRef

SHM_DIR = Path("/dev/shm")
ALIGN = 64


def _check_name(name: str) -> str:
    if not name or "/" in name or name.startswith("."):
        raise BadRequest(f"invalid shared-memory segment name {name!r}")
    return name


def write_segment(name: str, arrays: dict[str, np.ndarray]) -> list[ArrayRef]:
    """Create segment ``name`` (mode 0600, must not exist) holding ``arrays``; returns descriptors."""
    _check_name(name)
    refs, offset = [], 0
    prepared = []
    for key, arr in arrays.items():
        arr = np.ascontiguousarray(arr)
        refs.append(ArrayRef(key, arr.dtype.name, tuple(arr.shape), name, offset))
        prepared.append((offset, arr))
        offset += (arr.nbytes + ALIGN - 1) // ALIGN * ALIGN
    size = max(offset, 1)
    fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size) as mm:
            for off, arr in prepared:
                if arr.nbytes:
                    np.frombuffer(mm, dtype=np.uint8, count=arr.nbytes, offset=off)[:] = arr.view(np.uint8).reshape(-1)
    except BaseException:
        os.unlink(SHM_DIR / name)
        raise
    finally:
        os.close(fd)
    return refs


def map_segments(refs: Iterable[ArrayRef]) -> dict[str, np.ndarray]:
    """Read-only numpy views over the named segments (one mapping per segment, shared by arrays)."""
    maps: dict[str, mmap.mmap] = {}
    out = {}
    for ref in refs:
        assert ref.segment is not None
        mm = maps.get(ref.segment)
        if mm is None:
            path = SHM_DIR / _check_name(ref.segment)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                raise NotFound(
                    f"shared-memory segment {ref.segment} is gone (released, or reclaimed after the "
                    "client's lease ran out); ask again or use frames transport"
                ) from None
            try:
                size = os.fstat(fd).st_size
                mm = maps[ref.segment] = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
        if ref.offset + ref.nbytes > len(mm):
            raise BadRequest(f"array {ref.key!r} reaches past the end of segment {ref.segment}")
        count = int(np.prod(ref.shape, dtype=np.int64))
        out[ref.key] = np.frombuffer(mm, dtype=ref.dtype, count=count, offset=ref.offset).reshape(ref.shape)
    return out


def unlink(name: str) -> bool:
    try:
        os.unlink(SHM_DIR / _check_name(name))
        return True
    except FileNotFoundError:
        return False


def list_segments(prefix: str) -> list[str]:
    return [p.name for p in SHM_DIR.glob(f"{prefix}*")]
