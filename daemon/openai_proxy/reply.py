"""What a request asks of the model's reply, applied to the ids of one generated turn: ``stop``
strings (the ids cut after the token that completes the first match, the match left out of the
text), the end-of-turn or other stop token left out of the text, ``response_format`` checked, and
each token's true bytes for ``logprobs``.

The model is not constrained while it generates (the trainer's sampling rules each turn), so a
reply that breaks what the request asked for is refused (BadRequest naming the field), never
rewritten to fit: the trajectory must hold what the model wrote.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import cache
from typing import Any

import jsonschema

from rolloutd.daemon.inference.base import GenerateResult, VersionSpan
from rolloutd.native_io.errors import BadRequest

UNSATISFIED = "reply_does_not_satisfy_request"


def unsatisfied(param: str, message: str) -> BadRequest:
    return BadRequest(message + "; the reply is not returned or recorded (send the request again to sample anew)",
                      details={"param": param, "code": UNSATISFIED})


@dataclass(frozen=True)
class ResponseFormat:
    """``response_format``: ``text``, ``json_object`` or ``json_schema`` (with its schema)."""

    type: str = "text"
    schema: dict[str, Any] | None = None

    def check(self, content: str | None) -> None:
        """BadRequest when the reply's content is not what the format asks for."""
        if self.type == "text":
            return
        try:
            value = json.loads(content or "")
        except ValueError as e:
            raise unsatisfied("response_format", f"response_format is {self.type!r} but the model's reply is not "
                                                 f"JSON ({e})") from e
        if self.type == "json_object" and not isinstance(value, dict):
            raise unsatisfied("response_format", "response_format is 'json_object' but the model's reply is JSON "
                                                 f"{type(value).__name__}, not an object")
        if self.schema is not None:
            error = jsonschema.exceptions.best_match(_validator(json.dumps(self.schema)).iter_errors(value))
            if error is not None:
                raise unsatisfied("response_format", f"the model's reply does not match the json_schema: "
                                                     f"{error.message} (at {list(error.absolute_path)})")


@cache
def _validator(schema: str) -> jsonschema.protocols.Validator:
    value = json.loads(schema)
    return jsonschema.validators.validator_for(value)(value)


def parse_response_format(value: Any) -> ResponseFormat:
    """The request's ``response_format``, or BadRequest (``param`` response_format)."""
    if value is None:
        return ResponseFormat()
    kind = value.get("type") if isinstance(value, dict) else None
    if kind in ("text", "json_object"):
        return ResponseFormat(kind)
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise BadRequest("response_format.json_schema.schema must be a JSON schema object",
                             details={"param": "response_format"})
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.exceptions.SchemaError as e:
            raise BadRequest(f"response_format.json_schema.schema is not a valid JSON schema: {e.message}",
                             details={"param": "response_format"}) from e
        return ResponseFormat(kind, schema)
    raise BadRequest("response_format.type must be 'text', 'json_object' or 'json_schema'",
                     details={"param": "response_format"})


def cut_at_stop(result: GenerateResult, stops: tuple[str, ...], searched: int, decode: Any
                ) -> tuple[GenerateResult, int | None]:
    """(the turn cut after the token that completes the first match of a ``stops`` string in the
    text of its first ``searched`` ids, with finish reason ``stop``; the match's character
    offset), or (the turn, None) when no stop string occurs there. ``decode``: ids -> text."""
    ids = result.token_ids.tolist()
    text = decode(ids[:searched]) if stops else ""
    found = [(at, len(s)) for s in stops if (at := text.find(s)) >= 0]
    if not found:
        return result, None
    at, length = min(found)
    # The shortest prefix of ids whose text covers the match (prefix texts grow with the prefix;
    # a character still incomplete decodes as U+FFFD and does not count).
    lo, hi = 1, searched
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(ids[:mid]).rstrip("\ufffd")) >= at + length:
            hi = mid
        else:
            lo = mid + 1
    spans = tuple(VersionSpan(s.version, s.start, min(s.end, lo)) for s in result.weight_spans if s.start < lo)
    return dataclasses.replace(result, token_ids=result.token_ids[:lo], logprobs=result.logprobs[:lo],
                               finish_reason="stop", weight_spans=spans), at


def reply_end(ids: list[int], finish_reason: str, eot_id: int, special_ids: frozenset[int]) -> int:
    """How many of a turn's ids the reply's text holds: not the token that ended the turn (the
    template's end of turn, or another special stop token such as ``<|endoftext|>``)."""
    if ids and (ids[-1] == eot_id or (finish_reason == "stop" and ids[-1] in special_ids)):
        return len(ids) - 1
    return len(ids)


@cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: printable stand-in character -> the byte it stands for."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_bytes(tokenizer: Any, token_id: int, special_ids: frozenset[int], decode: Any) -> bytes:
    """The bytes ``token_id`` stands for, also when it holds part of a multi-byte character (its
    decoded text alone would be U+FFFD): byte-level BPE pieces are mapped back through their
    alphabet, SentencePiece byte fallbacks (``<0xE2>``) read as their byte."""
    if token_id in special_ids:
        return decode([token_id]).encode()
    piece = tokenizer.convert_ids_to_tokens(token_id)
    alphabet = _byte_level_alphabet()
    if isinstance(piece, str) and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    text = decode([token_id])
    if "\ufffd" in text and isinstance(piece, str) and all(c in alphabet for c in piece):
        return bytes(alphabet[c] for c in piece)
    return text.encode()
