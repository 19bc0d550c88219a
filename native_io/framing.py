"""Multipart message framing: ``[type byte][msgpack header][raw array frame]...``.

The type is a frame of its own so a router can dispatch without decoding; the header is a small
msgpack map; arrays never go inside it: they follow as raw frames (sent without a copy) or live
in a shared-memory segment the header names (see :mod:`shm`). This module knows nothing of
rollouts: the message vocabulary is in ``rolloutd.native_io.wire``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from .errors import BadRequest, MessageTooLarge, UnsupportedVersion

PROTOCOL_VERSION = 1
_ITEMSIZE = {"int32": 4, "int64": 8, "uint8": 1, "float32": 4, "float64": 8, "bool": 1}
ALLOWED_DTYPES = frozenset(_ITEMSIZE)


@dataclass(frozen=True)
class ArrayRef:
    """Where one array of a message lives."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    segment: str | None
    """Shared-memory segment name, or None when the array is raw frame number ``offset``."""
    offset: int
    """Byte offset in the segment, or the index of the frame among the message's buffers."""

    def to_wire(self) -> list[Any]:
        return [self.key, self.dtype, list(self.shape), self.segment, self.offset]

    @classmethod
    def from_wire(cls, item: Any) -> "ArrayRef":
        try:
            key, dtype, shape, segment, offset = item
            ref = cls(str(key), str(dtype), tuple(int(x) for x in shape), segment, int(offset))
        except (TypeError, ValueError) as e:
            raise BadRequest(f"malformed array descriptor {item!r}") from e
        if ref.dtype not in ALLOWED_DTYPES:
            raise BadRequest(f"array {ref.key!r}: dtype {ref.dtype!r} not allowed ({sorted(ALLOWED_DTYPES)})")
        if any(d < 0 for d in ref.shape) or ref.offset < 0:
            raise BadRequest(f"array {ref.key!r}: negative shape or offset")
        if ref.segment is not None and not isinstance(ref.segment, str):
            raise BadRequest(f"array {ref.key!r}: segment must be a string")
        return ref

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ITEMSIZE[self.dtype]


def pack_header(header: dict[str, Any]) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, **header}, use_bin_type=True)


def encode(msg_type: int, header: dict[str, Any], buffers: list[Any] | None = None) -> list[Any]:
    return [bytes((msg_type,)), pack_header(header), *(buffers or [])]


def decode(frames: list[Any], *, max_bytes: int, known_types: frozenset[int]) -> tuple[int, dict[str, Any], list[Any]]:
    """Split and check a message; raises BadRequest subclasses with a reason a user can act on.

    ``frames`` may be ``bytes`` or ``zmq.Frame`` (``.bytes``/``.buffer``); buffers are returned as
    they came, so large array frames are never copied here.
    """
    if len(frames) < 2:
        raise BadRequest(f"a message has at least 2 frames (type, header); got {len(frames)}")
    total = sum(len(_view(f)) for f in frames)
    if total > max_bytes:
        raise MessageTooLarge(
            f"message of {total} bytes exceeds the daemon's limit of {max_bytes} bytes (max_message_bytes)"
        )
    type_frame = _view(frames[0])
    if len(type_frame) != 1 or type_frame[0] not in known_types:
        raise BadRequest(f"unknown message type frame {bytes(type_frame[:8])!r}")
    try:
        header = msgpack.unpackb(_view(frames[1]), raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise BadRequest(f"header is not valid msgpack: {e}") from e
    if not isinstance(header, dict):
        raise BadRequest("header must be a msgpack map")
    version = header.get("v")
    if version != PROTOCOL_VERSION:
        raise UnsupportedVersion(
            f"protocol version {version!r} is not supported (this daemon speaks {PROTOCOL_VERSION}); "
            "upgrade the client or the daemon so they match"
        )
    return type_frame[0], header, list(frames[2:])


def _view(frame: Any) -> memoryview:
    if isinstance(frame, (bytes, bytearray, memoryview)):
        return memoryview(frame)
    return memoryview(frame.buffer)


def arrays_to_frames(arrays: dict[str, np.ndarray]) -> tuple[list[ArrayRef], list[memoryview]]:
    refs, bufs = [], []
    for key, arr in arrays.items():
        arr = np.ascontiguousarray(arr)
        refs.append(ArrayRef(key, arr.dtype.name, tuple(arr.shape), None, len(bufs)))
        bufs.append(memoryview(arr).cast("B"))
    return refs, bufs


def arrays_from_frames(refs: list[ArrayRef], buffers: list[Any]) -> dict[str, np.ndarray]:
    out = {}
    for ref in refs:
        if ref.offset >= len(buffers):
            raise BadRequest(f"array {ref.key!r} names frame {ref.offset}, but only {len(buffers)} came")
        view = _view(buffers[ref.offset])
        if len(view) != ref.nbytes:
            raise BadRequest(f"array {ref.key!r}: frame has {len(view)} bytes, descriptor says {ref.nbytes}")
        out[ref.key] = np.frombuffer(view, dtype=ref.dtype).reshape(ref.shape)
    return out
