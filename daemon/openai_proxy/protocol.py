"""The OpenAI chat-completions wire shapes the proxy reads and writes.

Requests are parsed into :class:`ChatRequest` (messages normalised into :class:`ChatMessage`);
replies are built from the model's text, whose Hermes ``<tool_call>{json}</tool_call>`` blocks
become ``tool_calls`` when the request offered tools (:class:`ToolChoice`). What is accepted but
not applied (sampling fields: the trainer's sampling parameters rule every turn) is listed in
``ChatRequest.ignored`` so the trajectory can report it. Shapes follow the OpenAI API closely
enough for the official SDK to parse them (tests drive it): ``chat.completion``,
``chat.completion.chunk`` with content and tool-call deltas, ``list`` of ``model``.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from rolloutd.daemon.agents.toolcalls import OPEN_TAG, TOOL_CALL
from rolloutd.native_io.errors import BadRequest

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
# Fields the proxy reads, or accepts knowing it does not apply them.
_APPLIED = {"model", "messages", "tools", "stream", "stream_options", "max_tokens", "max_completion_tokens",
            "n", "logprobs", "tool_choice", "parallel_tool_calls"}
TOOL_CHOICE_MODES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolCallItem:
    id: str
    name: str
    arguments: str
    """JSON text, as the API carries it."""

    def same_call(self, other: ToolCallItem) -> bool:
        """Same function and arguments (JSON compared as values: key order and spacing aside)."""
        return self.name == other.name and _json_value(self.arguments) == _json_value(other.arguments)


@dataclass(frozen=True)
class ChatMessage:
    role: str
    """``system``, ``user``, ``assistant`` or ``tool`` (``developer`` is read as ``system``)."""
    content: str | None
    tool_calls: tuple[ToolCallItem, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None

    def matches(self, seen: ChatMessage) -> bool:
        """Whether this message, sent back by the harness, is ``seen`` (what the proxy holds):
        an assistant reply may come back with its content's outer whitespace trimmed and its
        arguments re-serialised (tool call ids are not compared; templates do not render them);
        any other message must be identical."""
        if self.role != seen.role:
            return False
        if self.role != "assistant":
            return self == seen
        return ((self.content or "").strip() == (seen.content or "").strip()
                and len(self.tool_calls) == len(seen.tool_calls)
                and all(a.same_call(b) for a, b in zip(self.tool_calls, seen.tool_calls)))

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates take it (tool-call arguments as objects where they parse,
        as Qwen/Hermes templates expect)."""
        out: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": _json_value(c.arguments)}}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

    def api_dict(self) -> dict[str, Any]:
        """The message as a ``chat.completion`` choice carries it."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content, "refusal": None}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}} for c in self.tool_calls]
        return out


@dataclass(frozen=True)
class ToolChoice:
    """What a reply may hold, from ``tools``, ``tool_choice`` and ``parallel_tool_calls``."""

    mode: str = "none"
    """``none`` (no tools offered, or ``tool_choice: "none"``: the reply is plain content),
    ``auto``, ``required`` or ``function`` (the one named in :attr:`function`)."""
    function: str | None = None
    parallel: bool = True

    def reply(self, text: str, *, finished: bool) -> tuple[str | None, tuple[ToolCallItem, ...]]:
        """The model's text as content and tool calls; BadRequest (``param`` the field) when a
        finished reply does not satisfy the choice. The model is not constrained while it
        generates, so a reply that breaks the rule is refused, never rewritten to fit."""
        if self.mode == "none":
            return text, ()
        content, calls = parse_reply(text)
        if not finished:
            return content, calls
        if self.mode == "required" and not calls:
            raise _unsatisfied("tool_choice", "tool_choice is 'required' but the model's reply calls no tool")
        if self.mode == "function" and (not calls or any(c.name != self.function for c in calls)):
            raise _unsatisfied("tool_choice", f"tool_choice names {self.function!r} but the model's reply calls "
                                              f"{[c.name for c in calls] or 'no tool'}")
        if not self.parallel and len(calls) > 1:
            raise _unsatisfied("parallel_tool_calls", f"parallel_tool_calls is false but the model's reply makes "
                                                      f"{len(calls)} tool calls")
        return content, calls


def _unsatisfied(param: str, message: str) -> BadRequest:
    return BadRequest(message + "; the reply is not returned or recorded (send the request again to sample anew)",
                      details={"param": param, "code": "reply_does_not_satisfy_request"})


@dataclass
class ChatRequest:
    model: str
    messages: list[ChatMessage]
    tools: list[dict[str, Any]] | None
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    stream: bool = False
    include_usage: bool = False
    max_tokens: int | None = None
    logprobs: bool = False
    ignored: list[str] = field(default_factory=list)
    """Request fields accepted but not applied."""

    @property
    def tools_key(self) -> str:
        return json.dumps(self.tools or [], sort_keys=True)


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _text(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRequest(f"{where}.content[{i}]: only text parts ({{'type': 'text', 'text': ...}}) are "
                                 "supported", details={"param": f"{where}.content"})
            parts.append(part["text"])
        return "\n".join(parts)
    raise BadRequest(f"{where}.content must be a string, a list of text parts or null",
                     details={"param": f"{where}.content"})


def _optional_str(value: Any, where: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise BadRequest(f"{where} must be a string", details={"param": where})
    return value


def _tool_calls(value: Any, where: str) -> tuple[ToolCallItem, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise BadRequest(f"{where} must be a list", details={"param": where})
    calls = []
    for i, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest(f"{where}[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                             "'arguments': ...}}}}", details={"param": where})
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        calls.append(ToolCallItem(str(call.get("id") or ""), fn["name"], args))
    return tuple(calls)


def parse_message(raw: Any, index: int) -> ChatMessage:
    where = f"messages[{index}]"
    if not isinstance(raw, dict):
        raise BadRequest(f"{where} must be an object", details={"param": where})
    role = ROLES.get(raw.get("role"))  # type: ignore[arg-type]
    if role is None:
        raise BadRequest(f"{where}.role {raw.get('role')!r} is not one of {sorted(ROLES)}",
                         details={"param": f"{where}.role"})
    tool_calls = _tool_calls(raw.get("tool_calls"), f"{where}.tool_calls") if role == "assistant" else ()
    content = _text(raw.get("content"), where)
    if content is None and not tool_calls:
        if role != "assistant":
            raise BadRequest(f"{where}.content is required for role {role!r}", details={"param": f"{where}.content"})
    return ChatMessage(role, content, tool_calls, _optional_str(raw.get("tool_call_id"), f"{where}.tool_call_id"),
                       _optional_str(raw.get("name"), f"{where}.name"))


def parse_chat_request(body: Any) -> ChatRequest:
    """The request, or BadRequest naming the field at fault (``details["param"]``)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("model is required (any name: the proxy serves one policy)", details={"param": "model"})
    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise BadRequest("messages must be a non-empty list", details={"param": "messages"})
    messages = [parse_message(m, i) for i, m in enumerate(raw_messages)]
    if messages[-1].role == "assistant":
        raise BadRequest("the last message must not be an assistant message: continuing a prefilled reply is not "
                         "supported (the model's turns are generated, never written by the harness)",
                         details={"param": "messages"})
    if body.get("functions") is not None:
        raise BadRequest("the legacy 'functions' field is not supported; pass 'tools'", details={"param": "functions"})
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            for t in tools)):
        raise BadRequest("tools must be a list of {'type': 'function', 'function': {'name': ..., ...}}",
                         details={"param": "tools"})
    tool_choice = _tool_choice(body, tools or [])
    n = body.get("n", 1)
    if n not in (1, None):
        raise BadRequest("n must be 1: one trajectory holds one sample per turn", details={"param": "n"})
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise BadRequest("max_completion_tokens/max_tokens must be an integer >= 1", details={"param": "max_tokens"})
    options = body.get("stream_options") or {}
    return ChatRequest(
        model=model, messages=messages, tools=tools or None, tool_choice=tool_choice, stream=bool(body.get("stream")),
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        max_tokens=max_tokens, logprobs=bool(body.get("logprobs")),
        ignored=sorted(k for k, v in body.items() if k not in _APPLIED and v is not None))


def _tool_choice(body: dict[str, Any], tools: list[dict[str, Any]]) -> ToolChoice:
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadRequest("parallel_tool_calls must be true or false", details={"param": "parallel_tool_calls"})
    choice = body.get("tool_choice")
    names = [t["function"]["name"] for t in tools]
    function = None
    if choice is None:
        mode = "auto"
    elif isinstance(choice, str) and choice in TOOL_CHOICE_MODES:
        mode = choice
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
            and isinstance(choice["function"].get("name"), str):
        mode, function = "function", choice["function"]["name"]
        if function not in names:
            raise BadRequest(f"tool_choice names {function!r}, which is not among the tools {names}",
                             details={"param": "tool_choice"})
    else:
        raise BadRequest(f"tool_choice must be one of {list(TOOL_CHOICE_MODES)} or {{'type': 'function', "
                         "'function': {'name': ...}}", details={"param": "tool_choice"})
    if mode in ("required", "function") and not tools:
        raise BadRequest(f"tool_choice {choice!r} needs tools", details={"param": "tool_choice"})
    return ToolChoice("none" if not tools else mode, function, parallel is not False)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def parse_reply(text: str) -> tuple[str | None, tuple[ToolCallItem, ...]]:
    """The model's turn (end-of-turn token removed) as content and tool calls.

    Content is the text before the first ``<tool_call>`` without trailing whitespace (the
    template puts a newline back between content and calls); text after the last call is
    dropped. A turn whose blocks do not all parse as ``{"name": ..., "arguments": ...}`` is
    returned whole as content, with no tool calls, so the harness sees what the model wrote.
    """
    blocks = TOOL_CALL.findall(text)
    if not blocks:
        return text, ()
    calls = []
    for body in blocks:
        try:
            call = json.loads(body.strip())
        except ValueError:
            return text, ()
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return text, ()
        args = call.get("arguments", {})
        calls.append(ToolCallItem(new_call_id(), call["name"],
                                  args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)))
    content = text[:text.index(OPEN_TAG)].rstrip()
    return content or None, tuple(calls)


@dataclass
class Completion:
    """One answered request, ready to be written as a completion or a chunk stream."""

    id: str
    model: str
    message: ChatMessage
    finish_reason: str
    """``stop``, ``length`` or ``tool_calls``."""
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[tuple[str, float]] | None = None
    """(token text, log-probability) per generated token, when the request asked for them."""
    fingerprint: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def body(self) -> dict[str, Any]:
        logprobs = None
        if self.logprobs is not None:
            logprobs = {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                                    for t, lp in self.logprobs], "refusal": None}
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint,
                "choices": [{"index": 0, "message": self.message.api_dict(), "logprobs": logprobs,
                             "finish_reason": self.finish_reason}],
                "usage": self.usage()}

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}

    def chunks(self, *, include_usage: bool) -> list[dict[str, Any]]:
        """The stream's events: the role, the content in word-sized pieces, each tool call (id
        and name first, then its arguments in pieces), the finish reason, and the usage."""
        out = [self._chunk({"role": "assistant", "content": ""})]
        out += [self._chunk({"content": piece}) for piece in _pieces(self.message.content or "")]
        for i, call in enumerate(self.message.tool_calls):
            out.append(self._chunk({"tool_calls": [{"index": i, "id": call.id, "type": "function",
                                                    "function": {"name": call.name, "arguments": ""}}]}))
            out += [self._chunk({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
                    for piece in _pieces(call.arguments)]
        out.append(self._chunk({}, self.finish_reason))
        if include_usage:
            out.append({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                        "model": self.model, "system_fingerprint": self.fingerprint, "choices": [],
                        "usage": self.usage()})
        return out


def _pieces(text: str, size: int = 16) -> list[str]:
    """``text`` cut into pieces of about ``size`` characters (a stream's deltas join to it exactly)."""
    return [text[i:i + size] for i in range(0, len(text), size)]


def error_body(message: str, *, type_: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def models_body(model: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_body(model, created)]}


def model_body(model: str, created: int) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": created, "owned_by": "rolloutd"}
