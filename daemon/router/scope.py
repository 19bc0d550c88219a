"""Request ids as the router keeps them: each owned by the client that chose it.

A client is who it proved to be (its CURVE key over TCP; over the private ipc socket, the owner
uid or root, all one principal) plus the name it declares (``header["client"]``, one per client
object of the library, kept across its reconnects). Its id ``x`` becomes ``<tag>.x`` at the
router and on the nodes (``<tag>#<digest of x>`` when that would be too long), ``tag`` a digest of the owner: two trainers' ``x`` are two requests, a
cancel reaches only its owner's request, and a router that restarts computes the same key for
the same client's ``x``, so it can collect what a node finished for it. The client sees its own
id in every answer: the node's header is checked against the key it was sent and rewritten.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgpack

from rolloutd.daemon.common.request_book import MAX_ID_LEN, as_bytes
from rolloutd.native_io import framing
from rolloutd.native_io.errors import BadRequest

CLIENT_NAME_MAX = 64
"""Characters of the client name a trainer declares."""
TAG_BYTES = 6


def principal(frame: Any, local: bool) -> str:
    """Who sent ``frame``, as proved by its transport: the CURVE key, or the local owner."""
    if local:
        return "local"
    try:
        return f"key:{frame.get('User-Id')}"
    except Exception as e:  # noqa: BLE001 - a frame without properties: nothing proved
        raise BadRequest("this connection proved no key; use the CURVE client") from e


def owner_key(proved: str, header: dict[str, Any], rid: str) -> str:
    """The book key of ``rid`` for its owner (``proved`` + the client name it declares)."""
    name = header.get("client", "")
    if not isinstance(name, str) or len(name) > CLIENT_NAME_MAX:
        raise BadRequest(f"header.client must be a string of at most {CLIENT_NAME_MAX} characters (it names the "
                         "client, kept across its reconnects)")
    tag = hashlib.blake2b(f"{proved}\0{name}".encode(), digest_size=TAG_BYTES).hexdigest()
    key = f"{tag}.{rid}"
    # A node takes ids of MAX_ID_LEN at most: a long one is sent as its digest.
    return key if len(key) <= MAX_ID_LEN else f"{tag}#{hashlib.blake2b(rid.encode(), digest_size=32).hexdigest()}"


def to_node(frames: list[Any], header: dict[str, Any], key: str) -> list[Any]:
    """The request as a node gets it: under its key (arrays as they came, not copied)."""
    node_header = {k: v for k, v in header.items() if k != "client"} | {"id": key}
    return [frames[0], framing.pack_header(node_header), *frames[2:]]


def to_client(answer: list[Any], key: str, rid: str) -> list[Any] | None:
    """A node's answer under the client's own id; None when it does not answer ``key`` (a node
    that answers with another request's header is not believed)."""
    if len(answer) < 2:
        return None
    try:
        header = msgpack.unpackb(as_bytes(answer[1]), raw=False)
    except Exception:  # noqa: BLE001 - any undecodable header is a wrong answer
        return None
    if not isinstance(header, dict) or header.get("id") != key:
        return None
    header["id"] = rid
    result = header.get("result")
    for t in result.get("trajectories", []) if isinstance(result, dict) else []:
        if isinstance(t, dict) and t.get("request_id") == key:
            t["request_id"] = rid
    return [answer[0], msgpack.packb(header, use_bin_type=True), *answer[2:]]
