"""Reading a route's JSON body: bounded in size, time and nesting, checked against the fields the
published server's request models declare (``ProcessRequest``, ``CancelRequest``,
``LLMServerRequest``), faults listed as FastAPI lists them in a 422.

A body announced larger than the limit is refused before a byte is read (413), one that does not
arrive within :data:`READ_TIMEOUT_S` is refused (408) instead of holding the handler, and nesting
deeper than :data:`MAX_DEPTH` is refused instead of exhausting the parser's recursion.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from rolloutd.native_io.errors import InvalidBody, MessageTooLarge, OperationTimeout

MAX_BODY_BYTES = 64 * 1024 * 1024
READ_TIMEOUT_S = 30.0
MAX_DEPTH = 64
"""Deeper than any task record; the node's msgpack framing stops at 512."""


@dataclass(frozen=True)
class Field:
    name: str
    kind: type
    required: bool


PROCESS = (Field("instance", dict, True), Field("sampling_params", dict, True), Field("job_id", str, False))
PROCESS_NATIVE = (Field("instance", dict, True), Field("sampling_params", dict, False), Field("job_id", str, False))
CANCEL = (Field("job_id", str, True),)
LLM_SERVER = (Field("address", str, True),)


async def read_body(request: web.Request, fields: tuple[Field, ...]) -> dict[str, Any]:
    """The body as a dict holding ``fields`` (optional ones may be absent or null); InvalidBody
    lists every fault, MessageTooLarge and OperationTimeout say what to change."""
    if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
        raise MessageTooLarge(f"the body announces {request.content_length} bytes; the gateway takes at most "
                              f"{MAX_BODY_BYTES}")
    try:
        async with asyncio.timeout(READ_TIMEOUT_S):
            raw = await request.read()
    except TimeoutError as e:
        raise OperationTimeout(f"the request body did not arrive within {READ_TIMEOUT_S:g} s",
                               details={"http_status": 408}) from e
    except web.HTTPRequestEntityTooLarge as e:
        raise MessageTooLarge(f"the body is larger than {MAX_BODY_BYTES} bytes") from e
    try:
        body = json.loads(raw) if raw else None
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise _invalid([{"type": "json_invalid", "loc": ["body"], "msg": f"JSON decode error: {e}"}]) from e
    if not isinstance(body, dict):
        kind = "missing" if body is None else "model_attributes_type"
        raise _invalid([{"type": kind, "loc": ["body"], "msg": "the body must be a JSON object with "
                         + ", ".join(f.name for f in fields)}])
    if _depth(body) > MAX_DEPTH:
        raise _invalid([{"type": "json_invalid", "loc": ["body"],
                         "msg": f"JSON nested deeper than {MAX_DEPTH} levels"}])
    errors = []
    for f in fields:
        value = body.get(f.name)
        if value is None:
            if f.required:
                errors.append({"type": "missing", "loc": ["body", f.name], "msg": "Field required"})
        elif not isinstance(value, f.kind) or isinstance(value, bool):
            errors.append({"type": f"{f.kind.__name__}_type", "loc": ["body", f.name],
                           "msg": f"Input should be a valid {'dictionary' if f.kind is dict else 'string'}"})
    if errors:
        raise _invalid(errors)
    return body


def _invalid(errors: list[dict[str, Any]]) -> InvalidBody:
    text = "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in errors)
    return InvalidBody(f"invalid request body: {text}", details={"errors": errors})


def _depth(value: Any) -> int:
    """Nesting depth of parsed JSON, without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        if depth > MAX_DEPTH:
            return depth
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return deepest
