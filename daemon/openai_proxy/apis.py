"""The wire APIs the proxy speaks, each a view of the one chat session: how a request body
becomes a :class:`ChatRequest`, how a :class:`Completion` is written whole or as a stream, and
the API's error shape. The server serves them all through one handler."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from . import anthropic_api, responses_api
from .protocol import ChatRequest, Completion, error_body, parse_chat_request


def _openai_error(status: int, message: str, *, type_: str = "invalid_request_error", code: str | None = None,
                  param: str | None = None) -> web.Response:
    return web.json_response(error_body(message, type_=type_, code=code, param=param), status=status)


def _anthropic_error(status: int, message: str, *, type_: str = "", code: str | None = None,
                     param: str | None = None) -> web.Response:
    return web.json_response(anthropic_api.error_body(status, message if param is None else f"{message} ({param})",
                                                      code), status=status)


def _chat_frames(completion: Completion, request: ChatRequest) -> list[bytes]:
    chunks = completion.chunks(include_usage=request.include_usage)
    return [b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks] + [b"data: [DONE]\n\n"]


def _event_frames(events: Callable[[Completion], list[tuple[str, dict[str, Any]]]]
                  ) -> Callable[[Completion, ChatRequest], list[bytes]]:
    """Named-event streams (Anthropic's, the Responses API's): ``event:`` then ``data:``."""
    def frames(completion: Completion, request: ChatRequest) -> list[bytes]:
        return [f"event: {name}\ndata: {json.dumps(data)}\n\n".encode() for name, data in events(completion)]
    return frames


@dataclass(frozen=True)
class Api:
    parse: Callable[..., ChatRequest]
    """(body, unapplied=...) -> the chat request, or BadRequest naming the field."""
    body: Callable[[Completion], dict[str, Any]]
    frames: Callable[[Completion, ChatRequest], list[bytes]]
    """The Server-Sent Events of a streamed reply."""
    error: Callable[..., web.Response]
    """(status, message, type_=, code=, param=) -> the API's error response."""


CHAT = Api(parse_chat_request, Completion.body, _chat_frames, _openai_error)
APIS = {
    "/v1/chat/completions": CHAT,
    "/v1/messages": Api(anthropic_api.parse_messages_request, anthropic_api.message_body,
                        _event_frames(anthropic_api.message_events), _anthropic_error),
    "/v1/responses": Api(responses_api.parse_responses_request, responses_api.response_body,
                         _event_frames(responses_api.response_events), _openai_error),
}


def api_of(path: str) -> Api:
    """The API whose shapes a request on ``path`` is answered in (errors included)."""
    return APIS.get(path, CHAT)
