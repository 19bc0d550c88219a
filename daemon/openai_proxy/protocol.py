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

from .reply import ResponseFormat, parse_response_format, unsatisfied

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
# Fields the proxy reads, or accepts knowing it does not apply them.
_APPLIED = {"model", "messages", "tools", "stream", "stream_options", "max_tokens", "max_completion_tokens",
            "n", "logprobs", "top_logprobs", "tool_choice", "parallel_tool_calls", "stop", "response_format"}
NO_EFFECT = {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"}
"""Fields that ask nothing of the reply (who the caller is, what OpenAI would store or bill): accepted."""
UNAPPLIED_MODES = ("refuse", "report")
MAX_STOP_STRINGS = 4
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
            raise unsatisfied("tool_choice", "tool_choice is 'required' but the model's reply calls no tool")
        if self.mode == "function" and (not calls or any(c.name != self.function for c in calls)):
            raise unsatisfied("tool_choice", f"tool_choice names {self.function!r} but the model's reply calls "
                                              f"{[c.name for c in calls] or 'no tool'}")
        if not self.parallel and len(calls) > 1:
            raise unsatisfied("parallel_tool_calls", f"parallel_tool_calls is false but the model's reply makes "
                                                      f"{len(calls)} tool calls")
        return content, calls


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
    top_logprobs: int = 0
    stop: tuple[str, ...] = ()
    response_format: ResponseFormat = field(default_factory=ResponseFormat)
    ignored: list[str] = field(default_factory=list)
    """Request fields accepted but not applied (``unapplied="report"``)."""

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
    role = ROLES.get(raw["role"]) if isinstance(raw.get("role"), str) else None
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


def parse_chat_request(body: Any, *, unapplied: str = "refuse") -> ChatRequest:
    """The request, or BadRequest naming the field at fault (``details["param"]``). A field the
    proxy cannot apply (sampling fields: the trainer's sampling rules every turn) is refused, or
    with ``unapplied="report"`` accepted and listed in :attr:`ChatRequest.ignored`."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    ignored = sorted(k for k, v in body.items() if k not in _APPLIED and k not in NO_EFFECT and v is not None)
    if ignored and unapplied != "report":
        raise BadRequest(f"{ignored[0]} cannot be honoured by this proxy (the trainer's sampling parameters rule "
                         "every turn); leave it out, or set the agent's unapplied_fields to 'report' to accept and "
                         "report such fields", details={"param": ignored[0], "code": "unsupported_parameter"})
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
    max_tokens = None
    for name in ("max_completion_tokens", "max_tokens"):  # the newer name wins; a null one is absent
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise BadRequest(f"{name} must be an integer >= 1", details={"param": name})
        max_tokens = value if max_tokens is None else max_tokens
    for name in ("stream", "logprobs"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise BadRequest(f"{name} must be true or false", details={"param": name})
    top = body.get("top_logprobs")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= 20):
        raise BadRequest("top_logprobs must be an integer from 0 to 20", details={"param": "top_logprobs"})
    if top and not body.get("logprobs"):
        raise BadRequest("top_logprobs needs logprobs: true", details={"param": "top_logprobs"})
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("stream_options must be an object", details={"param": "stream_options"})
    return ChatRequest(
        model=model, messages=messages, tools=tools or None, tool_choice=tool_choice, stream=bool(body.get("stream")),
        include_usage=bool(options and options.get("include_usage")), max_tokens=max_tokens,
        logprobs=bool(body.get("logprobs")), top_logprobs=top or 0, stop=_stop(body.get("stop")),
        response_format=parse_response_format(body.get("response_format")), ignored=ignored)


def _stop(value: Any) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if stops is None:
        return ()
    if not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS or not all(
            isinstance(s, str) and s for s in stops):
        raise BadRequest(f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them",
                         details={"param": "stop"})
    return tuple(stops)


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


def function_tool(name: str, description: Any, parameters: Any) -> dict[str, Any]:
    """A tool another API describes, as chat's ``function`` (keys in chat's order: the template
    renders the tool as JSON, so the order is part of the prompt)."""
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    function["parameters"] = parameters or {"type": "object"}
    return function


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


@dataclass(frozen=True)
class TokenLogprob:
    """One token of a reply as ``logprobs.content`` lists it."""

    token: str
    logprob: float
    bytes: bytes
    """The bytes the token stands for (part of a character's, where it holds part of one)."""
    top: list[tuple[str, float, bytes]]
    """The most likely tokens at its position (token, log-probability, bytes), most likely first."""


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
    logprobs: list[TokenLogprob] | None = None
    """Per token of the reply's text, when the request asked for them."""
    fingerprint: str = ""
    stop_sequence: str | None = None
    """The request's ``stop`` string that ended the reply (the Anthropic API reports it)."""
    created: int = field(default_factory=lambda: int(time.time()))

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    def _logprobs(self) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        return {"content": [{"token": e.token, "logprob": e.logprob, "bytes": list(e.bytes),
                             "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(b)} for t, lp, b in e.top]}
                            for e in self.logprobs], "refusal": None}

    def body(self) -> dict[str, Any]:
        logprobs = self._logprobs()
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint,
                "choices": [{"index": 0, "message": self.message.api_dict(), "logprobs": logprobs,
                             "finish_reason": self.finish_reason}],
                "usage": self.usage()}

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None = None,
               logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint,
                "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}

    def chunks(self, *, include_usage: bool) -> list[dict[str, Any]]:
        """The stream's events: the role (with every token's log-probability when asked for:
        the turn is whole before the stream starts), the content in word-sized pieces, each tool
        call (id and name first, then its arguments in pieces), the finish reason, and the usage."""
        out = [self._chunk({"role": "assistant", "content": ""}, logprobs=self._logprobs())]
        out += [self._chunk({"content": piece}) for piece in pieces(self.message.content or "")]
        for i, call in enumerate(self.message.tool_calls):
            out.append(self._chunk({"tool_calls": [{"index": i, "id": call.id, "type": "function",
                                                    "function": {"name": call.name, "arguments": ""}}]}))
            out += [self._chunk({"tool_calls": [{"index": i, "function": {"arguments": piece}}]})
                    for piece in pieces(call.arguments)]
        out.append(self._chunk({}, self.finish_reason))
        if include_usage:
            out.append({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                        "model": self.model, "system_fingerprint": self.fingerprint, "choices": [],
                        "usage": self.usage()})
        return out


def pieces(text: str, size: int = 16) -> list[str]:
    """``text`` cut into pieces of about ``size`` characters (a stream's deltas join to it exactly)."""
    return [text[i:i + size] for i in range(0, len(text), size)]


def error_body(message: str, *, type_: str = "invalid_request_error", code: str | None = None,
               param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def models_body(model: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_body(model, created)]}


def model_body(model: str, created: int) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": created, "owned_by": "rolloutd"}
