"""The Anthropic Messages API (``POST /v1/messages``) as a view of the chat route.

A Messages request is translated into the chat-completions body it means (``system`` first,
``tool_use`` blocks as tool calls, ``tool_result`` blocks as tool messages, ``input_schema``
tools as function tools, ``stop_sequences`` as ``stop``) and parsed by the chat route's own
parser, so both APIs share one set of checks, one token history and one session; the reply is
the same :class:`Completion` written as a ``message`` or as Anthropic's event stream. A field
the translation does not know keeps its name, so the chat parser refuses it (or reports it,
``unapplied_fields: report``) under the name the harness sent.

What the translation cannot carry is refused with the block's path (images, documents,
thinking blocks): the model's context must hold what the harness sent, or nothing.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from rolloutd.native_io.errors import BadRequest

from .protocol import ChatRequest, Completion, function_tool, parse_chat_request, pieces

# Anthropic's fields with a chat-completions meaning of the same name or none at all.
_RENAMED = {"stop_sequences": "stop"}
_TRANSLATED = {"messages", "system", "tools", "tool_choice", "max_tokens", "stream", "model", "metadata"}
_STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 413: "request_too_large", 502: "api_error", 503: "overloaded_error"}


def parse_messages_request(body: Any, *, unapplied: str = "refuse") -> ChatRequest:
    """The request as the chat route's :class:`ChatRequest`, or BadRequest naming the field."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise BadRequest("max_tokens is required", details={"param": "max_tokens"})
    chat: dict[str, Any] = {k: v for k, v in body.items() if k not in _TRANSLATED and k not in _RENAMED}
    chat.update({_RENAMED[k]: v for k, v in body.items() if k in _RENAMED})
    chat.update(model=body.get("model"), max_tokens=max_tokens, stream=body.get("stream"))
    chat["messages"] = _system(body.get("system")) + _messages(body.get("messages"))
    tools = body.get("tools")
    if tools is not None:
        chat["tools"] = _tools(tools)
        chat.update(_tool_choice(body.get("tool_choice")))
    elif body.get("tool_choice") is not None:
        raise BadRequest("tool_choice needs tools", details={"param": "tool_choice"})
    return parse_chat_request(chat, unapplied=unapplied)


def _text_block(block: Any, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        raise BadRequest(f"{where} is a {kind!r} block; only text blocks are supported there",
                         details={"param": where})
    return block["text"]


def _text_blocks(blocks: list[Any], where: str) -> str:
    return "\n".join(_text_block(block, f"{where}[{i}]") for i, block in enumerate(blocks))


def _system(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "system", "content": value}]
    if isinstance(value, list):
        return [{"role": "system", "content": _text_blocks(value, "system")}]
    raise BadRequest("system must be a string or a list of text blocks", details={"param": "system"})


def _messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise BadRequest("messages must be a non-empty list", details={"param": "messages"})
    out: list[dict[str, Any]] = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise BadRequest(f"{where}.role must be 'user' or 'assistant'", details={"param": f"{where}.role"})
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            blocks = _assistant if role == "assistant" else _user
            out += blocks(content, f"{where}.content")
        else:
            raise BadRequest(f"{where}.content must be a string or a list of blocks",
                             details={"param": f"{where}.content"})
    return out


def _assistant(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """One assistant message: its text blocks joined, its ``tool_use`` blocks as tool calls."""
    texts, calls = [], []
    for i, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_use":
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input"), dict):
                raise BadRequest(f"{where}[{i}] must have a name and an object input",
                                 details={"param": f"{where}[{i}]"})
            calls.append({"id": block.get("id"), "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block["input"])}})
        else:
            texts.append(_text_block(block, f"{where}[{i}]"))
    out: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts) or None}
    if calls:
        out["tool_calls"] = calls
    return [out]


def _user(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """``tool_result`` blocks as tool messages (in order), then the text blocks as one user message."""
    results, texts = [], []
    for i, block in enumerate(blocks):
        if isinstance(block, dict) and block.get("type") == "tool_result":
            inner = block.get("content", "")
            text = inner if isinstance(inner, str) else _text_blocks(inner, f"{where}[{i}].content") \
                if isinstance(inner, list) else None
            if text is None or not isinstance(block.get("tool_use_id"), str):
                raise BadRequest(f"{where}[{i}] must have a tool_use_id and string or text-block content",
                                 details={"param": f"{where}[{i}]"})
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        else:
            texts.append(_text_block(block, f"{where}[{i}]"))
    return results + ([{"role": "user", "content": "\n".join(texts)}] if texts or not results else [])


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise BadRequest("tools must be a list", details={"param": "tools"})
    out = []
    for i, tool in enumerate(tools):
        client_tool = isinstance(tool, dict) and tool.get("type") in (None, "custom")
        if not client_tool or not isinstance(tool.get("name"), str):
            raise BadRequest(f"tools[{i}] must be a client tool {{'name', 'description', 'input_schema'}}; "
                             "server tools (web search, code execution...) are not served",
                             details={"param": f"tools[{i}]"})
        schema = tool.get("input_schema")
        out.append({"type": "function", "function": function_tool(tool["name"], tool.get("description"), schema)})
    return out


def _tool_choice(choice: Any) -> dict[str, Any]:
    if choice is None:
        return {}
    kind = choice.get("type") if isinstance(choice, dict) else None
    modes = {"auto": "auto", "any": "required", "none": "none"}
    if kind in modes:
        out: dict[str, Any] = {"tool_choice": modes[kind]}
    elif kind == "tool" and isinstance(choice.get("name"), str):
        out = {"tool_choice": {"type": "function", "function": {"name": choice["name"]}}}
    else:
        raise BadRequest("tool_choice must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': ...}",
                         details={"param": "tool_choice"})
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out


def _content(completion: Completion) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if completion.message.content:
        blocks.append({"type": "text", "text": completion.message.content})
    for call in completion.message.tool_calls:
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": tool_input(call.arguments)})
    return blocks


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as an input object; arguments the model wrote that are not a JSON object
    come as ``{"arguments": <the text>}`` (echoed back, that call reads as a history rewrite)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        value = arguments
    return value if isinstance(value, dict) else {"arguments": value}


def _stop_reason(completion: Completion) -> str:
    if completion.stop_sequence is not None:
        return "stop_sequence"
    return _STOP_REASONS.get(completion.finish_reason, "end_turn")


def _usage(completion: Completion) -> dict[str, int]:
    return {"input_tokens": completion.prompt_tokens, "output_tokens": completion.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


def message_body(completion: Completion) -> dict[str, Any]:
    return {"id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant", "model": completion.model,
            "content": _content(completion), "stop_reason": _stop_reason(completion),
            "stop_sequence": completion.stop_sequence, "usage": _usage(completion)}


def message_events(completion: Completion) -> list[tuple[str, dict[str, Any]]]:
    """The stream's (event, data) pairs: ``message_start``, each block's start, deltas (text in
    pieces, tool input as partial JSON) and stop, ``message_delta`` with the stop reason and usage,
    ``message_stop``."""
    whole = message_body(completion)
    start = {**whole, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {**whole["usage"], "output_tokens": 0}}
    events: list[tuple[str, dict[str, Any]]] = [("message_start", {"type": "message_start", "message": start})]
    for index, block in enumerate(whole["content"]):
        if block["type"] == "text":
            opening, deltas = {"type": "text", "text": ""}, [{"type": "text_delta", "text": p}
                                                              for p in pieces(block["text"])]
        else:
            opening = {**block, "input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": p} for p in pieces(json.dumps(block["input"]))]
        events.append(("content_block_start", {"type": "content_block_start", "index": index,
                                                "content_block": opening}))
        events += [("content_block_delta", {"type": "content_block_delta", "index": index, "delta": d})
                   for d in deltas]
        events.append(("content_block_stop", {"type": "content_block_stop", "index": index}))
    events.append(("message_delta", {"type": "message_delta", "usage": whole["usage"],
                                     "delta": {"stop_reason": whole["stop_reason"],
                                               "stop_sequence": whole["stop_sequence"]}}))
    events.append(("message_stop", {"type": "message_stop"}))
    return events


def error_body(status: int, message: str, code: str | None) -> dict[str, Any]:
    """Anthropic's error shape; ``code`` (rolloutd's reason, e.g. the trajectory ended) rides along."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message,
                                       "code": code}}
