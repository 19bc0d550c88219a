"""The OpenAI Responses API (``POST /v1/responses``) as a view of the chat route.

A Responses request is translated into the chat-completions body it means (``instructions`` as
the system message, ``input`` items as messages: an assistant ``message`` item and the
``function_call`` items after it form one assistant turn, a ``function_call_output`` is a tool
message; function tools, ``tool_choice``, ``max_output_tokens``, ``text.format``) and parsed by
the chat route's own parser, so both APIs share one set of checks, one token history and one
session; the reply is the same :class:`Completion` written as a ``response`` object or as the
Responses event stream. A field the translation does not know keeps its name, so the chat
parser refuses it (or reports it, ``unapplied_fields: report``) under the name the harness sent.

The proxy keeps no responses (``store`` has no effect): ``previous_response_id`` is refused,
the harness sends the whole conversation as ``input`` each time (as Codex-style agents and the
Agents SDK do).
"""

from __future__ import annotations

import secrets
from typing import Any

from rolloutd.native_io.errors import BadRequest

from .protocol import ChatRequest, Completion, function_tool, parse_chat_request, pieces

_TRANSLATED = {"input", "instructions", "tools", "tool_choice", "max_output_tokens", "text", "previous_response_id"}
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


def _no_effect(name: str, value: Any) -> bool:
    """Fields that ask nothing of the reply as sent by common clients (nothing to include, no truncation)."""
    return (name == "include" and value == []) or (name == "truncation" and value == "disabled")


def parse_responses_request(body: Any, *, unapplied: str = "refuse") -> ChatRequest:
    """The request as the chat route's :class:`ChatRequest`, or BadRequest naming the field."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    if body.get("previous_response_id") is not None:
        raise BadRequest("previous_response_id is not supported: this proxy keeps no responses; send the whole "
                         "conversation as input", details={"param": "previous_response_id"})
    chat: dict[str, Any] = {k: v for k, v in body.items() if k not in _TRANSLATED and not _no_effect(k, v)}
    chat["max_tokens"] = body.get("max_output_tokens")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("instructions must be a string", details={"param": "instructions"})
    system = [{"role": "system", "content": instructions}] if instructions else []
    chat["messages"] = system + _input(body.get("input"))
    tools = body.get("tools")
    if tools:
        chat["tools"] = _tools(tools)
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    chat["tool_choice"] = choice
    chat["response_format"] = _format(body.get("text"))
    return parse_chat_request(chat, unapplied=unapplied)


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where} must be a string or a list of text parts", details={"param": where})
    texts = []
    for i, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise BadRequest(f"{where}[{i}] is a {kind!r} part; only text parts are supported",
                             details={"param": f"{where}[{i}]"})
        texts.append(part["text"])
    return "\n".join(texts)


def _input(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise BadRequest("input must be a string or a non-empty list of items", details={"param": "input"})
    out: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in _ROLES:
            text = _text(item.get("content"), f"{where}.content")
            if item["role"] == "assistant" and out and out[-1]["role"] == "assistant" and "tool_calls" not in out[-1]:
                out[-1]["content"] += "\n" + text  # one turn written as several message items
            else:
                out.append({"role": item["role"], "content": text})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("arguments"), str):
                raise BadRequest(f"{where} must have a name and string arguments", details={"param": where})
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if not out or out[-1]["role"] != "assistant":
                out.append({"role": "assistant", "content": None})
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise BadRequest(f"{where}.call_id must be a string", details={"param": f"{where}.call_id"})
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _text(item.get("output"), f"{where}.output")})
        else:
            role = f" with role {item.get('role')!r}" if kind == "message" else ""
            raise BadRequest(f"{where} is a {kind!r} item{role}; "
                             "supported: message (user, system, developer, assistant), function_call, "
                             "function_call_output", details={"param": where})
    return out


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise BadRequest("tools must be a list", details={"param": "tools"})
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise BadRequest(f"tools[{i}] is a {kind!r} tool; only function tools are served (built-in tools such as "
                             "web search run at OpenAI)", details={"param": f"tools[{i}]"})
        schema = tool.get("parameters")
        out.append({"type": "function", "function": function_tool(tool["name"], tool.get("description"), schema)})
    return out


def _format(text: Any) -> dict[str, Any] | None:
    """``text.format`` as the chat route's ``response_format``."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema")}}
    return fmt


def _output(completion: Completion) -> list[dict[str, Any]]:
    status = "incomplete" if completion.finish_reason == "length" else "completed"
    items: list[dict[str, Any]] = []
    if completion.message.content:
        items.append({"id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant", "status": status,
                      "content": [{"type": "output_text", "text": completion.message.content, "annotations": [],
                                   "logprobs": []}]})
    for call in completion.message.tool_calls:
        items.append({"id": "fc_" + secrets.token_hex(12), "type": "function_call", "call_id": call.id,
                      "name": call.name, "arguments": call.arguments, "status": "completed"})
    return items


def response_body(completion: Completion) -> dict[str, Any]:
    done = completion.finish_reason != "length"
    return {"id": "resp_" + completion.id.rpartition("-")[2], "object": "response", "created_at": completion.created,
            "status": "completed" if done else "incomplete",
            "incomplete_details": None if done else {"reason": "max_output_tokens"},
            "model": completion.model, "output": _output(completion),
            "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "error": None,
            "usage": {"input_tokens": completion.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": completion.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": completion.prompt_tokens + completion.completion_tokens}}


def response_events(completion: Completion) -> list[tuple[str, dict[str, Any]]]:
    """The stream's (event, data) pairs: ``response.created``, for each output item its
    ``output_item.added``, deltas (text, or function arguments) and ``.done`` events, then
    ``response.completed`` (``response.incomplete`` when the turn hit its token limit)."""
    whole = response_body(completion)
    events: list[dict[str, Any]] = [{"type": "response.created",
                                     "response": {**whole, "status": "in_progress", "output": [], "usage": None,
                                                  "incomplete_details": None}}]
    for index, item in enumerate(whole["output"]):
        at = {"output_index": index, "item_id": item["id"]}
        if item["type"] == "message":
            part = item["content"][0]
            events.append({"type": "response.output_item.added", "output_index": index,
                           "item": {**item, "status": "in_progress", "content": []}})
            events.append({"type": "response.content_part.added", **at, "content_index": 0,
                           "part": {**part, "text": ""}})
            events += [{"type": "response.output_text.delta", **at, "content_index": 0, "delta": p, "logprobs": []}
                       for p in pieces(part["text"])]
            events.append({"type": "response.output_text.done", **at, "content_index": 0, "text": part["text"],
                           "logprobs": []})
            events.append({"type": "response.content_part.done", **at, "content_index": 0, "part": part})
        else:
            events.append({"type": "response.output_item.added", "output_index": index,
                           "item": {**item, "status": "in_progress", "arguments": ""}})
            events += [{"type": "response.function_call_arguments.delta", **at, "delta": p}
                       for p in pieces(item["arguments"])]
            events.append({"type": "response.function_call_arguments.done", **at, "name": item["name"],
                           "arguments": item["arguments"]})
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
    events.append({"type": f"response.{whole['status']}", "response": whole})
    return [(e["type"], {**e, "sequence_number": n}) for n, e in enumerate(events)]
