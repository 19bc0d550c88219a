"""The token history behind a black-box agent's requests: what the model saw, kept as ids.

A harness sends its whole conversation with every request. The proxy keeps, per *segment*, a
:class:`TokenLedger` (the running token list, the source of truth) and the messages as the
proxy knows them: the harness's non-assistant messages as they were sent and the model's replies
as the proxy returned them. A request **extends** a segment when it starts with exactly those
messages (a reply may come back with trimmed content or re-serialised arguments, see
:meth:`ChatMessage.matches`) and adds only non-assistant messages; only those are encoded
(template framing included, mask 0) and the earlier ids stay as they are.

Anything else is a **history rewrite**: an edited or dropped message, a changed reply, an
assistant message the model did not write, other tools, a reply regenerated. The request then
starts a new segment from a fresh render of its messages; nothing is spliced into an existing
segment. Several conversations of one harness (a main agent and a sub-agent) are several
segments, each extended by its own requests. A request that does extend a segment whose chat
template cannot append its messages token by token (the template re-renders earlier text for
them) starts a new segment too; ``metrics["template_unextendable"]`` says why, once.

What the trajectory holds (:meth:`History.outcome`):

- ``keep="all"`` (default): every segment that produced a model turn, in order of creation.
  ``prompt_ids`` is the first segment's prompt; ``response_ids`` is the first segment's response,
  then for each later segment its own full prompt (mask 0) followed by its response. ``segments``
  gives each segment's range in ``response_ids``, so every range is one consistent token
  history: the first extends ``prompt_ids``, a later one stands alone (its prompt is inside it).
  A trainer must condition each range only on itself (``client.history_segments`` splits them);
  ``template_append_only`` is False whenever there is more than one segment.
- ``keep="last"``: only the segment that produced the last model turn; ``segments`` is one range
  and the arrays are one history a trainer can use as it is. Earlier segments are dropped.

Either way ``metrics["history_segments"]`` describes every segment (why it began, its prompt
length, its turns, whether it is in the arrays) and ``metrics["history_rewritten"]`` is True
once any request extended no segment (a rewrite, or a second conversation);
``metrics["history_rewrites"]`` says for each such request what differed.
"""

from __future__ import annotations

import functools
import itertools
import logging
import sys
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rolloutd.daemon.agents.base import AgentOutcome
from rolloutd.daemon.agents.content_text import ContentText
from rolloutd.daemon.agents.tokens import TokenLedger
from rolloutd.daemon.inference.base import GenerateResult
from rolloutd.native_io.errors import BadRequest, ConfigError

from .admission import context_exceeded
from .protocol import ChatMessage, ChatRequest
from .reply import cut_at_stop, reply_end

log = logging.getLogger(__name__)

KEEP_MODES = ("all", "last")


@dataclass
class Segment:
    index: int
    ledger: TokenLedger
    tools_key: str
    known: list[ChatMessage]
    """The conversation as the model saw it: sent messages, and the replies as returned."""
    reason: str
    """Why the segment began (``first request`` for the first)."""
    first_request: int
    turns: int = 0
    last_turn_at: int = -1
    """Sequence number of the segment's latest model turn (orders segments for ``keep="last"``)."""

    @property
    def awaiting_reply(self) -> bool:
        return self.known[-1].role != "assistant"

    def extension(self, request: ChatRequest) -> list[ChatMessage] | None:
        """The messages ``request`` adds to this segment, or None when it does not extend it."""
        msgs = request.messages
        if request.tools_key != self.tools_key or len(msgs) < len(self.known):
            return None
        if not all(m.matches(k) for m, k in zip(msgs, self.known)):
            return None
        new = msgs[len(self.known):]
        if self.awaiting_reply:
            # The previous request got no reply (it failed): only the same request again continues.
            return [] if not new else None
        if not new or any(m.role == "assistant" for m in new):
            return None
        return new

    def divergence(self, request: ChatRequest) -> tuple[int, str]:
        """(messages shared with ``request`` before they part, what differs), for the notes."""
        msgs = request.messages
        shared = next((i for i, (m, k) in enumerate(zip(msgs, self.known)) if not m.matches(k)),
                      min(len(msgs), len(self.known)))
        if request.tools_key != self.tools_key:
            return shared, "the request's tools differ from the ones the model saw"
        if shared < min(len(msgs), len(self.known)):
            seen = self.known[shared]
            if seen.role == "assistant":
                return shared, f"message {shared} differs from the model's reply there (content or tool calls edited)"
            return shared, f"message {shared} ({seen.role}) differs from the one sent before"
        if len(msgs) < len(self.known):
            return shared, f"the request drops messages {shared}.. (history cut, or a reply asked for again)"
        if self.awaiting_reply:
            return shared, "the request adds messages after a request that got no reply"
        added = next((i for i in range(shared, len(msgs)) if msgs[i].role == "assistant"), shared)
        return shared, f"message {added} is an assistant message the model did not write"


@dataclass
class Turn:
    """One answered request, as the proxy returns it."""

    message: ChatMessage
    finish_reason: str
    """The API's: ``stop``, ``length`` or ``tool_calls``."""
    prompt_tokens: int
    result: GenerateResult
    """The model's turn as recorded (cut at a ``stop`` string)."""
    reply_ids: int
    """How many of its ids the reply's text holds (not the token that ended the turn)."""
    stop_sequence: str | None = None
    """The request's ``stop`` string that ended the turn, if one did."""


@dataclass
class History:
    """Every segment of one rollout; not safe for concurrent use (the session serialises it)."""

    tokenizer: Any
    max_context_tokens: int
    template_check: str = "final"
    content_special_tokens: str = "text"
    """How the harness's messages treat added tokens' text (see ``agents.content_text``)."""
    segments: list[Segment] = field(default_factory=list)
    rewrites: list[dict[str, Any]] = field(default_factory=list)
    requests: int = 0
    template_unextendable: str | None = None
    """Why the chat template could not extend a segment token by token, the first time it could not."""
    _turn_seq: itertools.count = field(default_factory=itertools.count)
    content: ContentText = field(init=False)
    """Encodes every segment's messages; its counts are the trajectory's."""

    def __post_init__(self) -> None:
        self.content = ContentText(self.tokenizer, self.content_special_tokens)

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        return frozenset(getattr(self.tokenizer, "all_special_ids", ()) or ())

    def prepare(self, request: ChatRequest) -> Segment:
        """The segment ``request`` continues, its new messages appended; or a new segment.

        Raises BadRequest when the new messages or a fresh prompt do not fit max_context_tokens
        (``details["code"] == "context_length_exceeded"``) or the template cannot render them.
        """
        self.requests += 1
        for segment in sorted(self.segments, key=lambda s: s.last_turn_at, reverse=True):
            new = segment.extension(request)
            if new is None:
                continue
            if new:
                try:
                    fits = segment.ledger.add_messages([m.template_dict() for m in new])
                except ConfigError as e:
                    # The template re-renders earlier text for these messages: no token-by-token
                    # extension exists, so the request gets a fresh render of its own.
                    return self._new_segment(request, (segment, str(e)))
                if not fits:
                    raise context_exceeded(f"the new messages do not fit: {segment.ledger.room} tokens are left "
                                           f"under max_context_tokens={self.max_context_tokens}")
                segment.known.extend(new)
            return segment
        return self._new_segment(request)

    def _new_segment(self, request: ChatRequest, unextendable: tuple[Segment, str] | None = None) -> Segment:
        """A segment from a fresh render of ``request``; ``unextendable``: the segment it extends
        and why the template could not append its new messages (said once per trajectory)."""
        reason = "first request"
        shared = 0
        if unextendable is not None:
            extended, why = unextendable
            shared = len(extended.known)
            reason = (f"request {self.requests} extends segment {extended.index}, but the chat template cannot "
                      "append its new messages token by token (template_unextendable says why)")
            if self.template_unextendable is None:
                self.template_unextendable = why
                log.warning("openai proxy: the chat template cannot append observations token by token (%s); "
                            "such requests start new segments from a fresh render", why)
        elif self.segments:
            # Report against the segment that shares the most with the request.
            closest = max(reversed(self.segments), key=lambda s: s.divergence(request)[0])
            shared, what = closest.divergence(request)
            reason = f"request {self.requests} does not extend segment {closest.index}: {what}"
        base = [m.template_dict() for m in request.messages]
        try:
            # Unbounded at first: a prompt over the limit is the harness's error, not a bad config.
            ledger = TokenLedger(self.tokenizer, base, request.tools, max_total_tokens=sys.maxsize,
                                 template_check=self.template_check, content=self.content)
        except ConfigError as e:
            raise BadRequest(f"the chat template cannot render the conversation: {e}") from e
        if len(ledger.ids) >= self.max_context_tokens:
            raise context_exceeded(f"the conversation is {len(ledger.ids)} tokens, not below "
                                   f"max_context_tokens={self.max_context_tokens}")
        ledger.max_total_tokens = self.max_context_tokens
        segment = Segment(len(self.segments), ledger, request.tools_key, list(request.messages), reason, self.requests)
        if self.segments:
            log.warning("history rewrite: %s; segment %d starts from a fresh render", reason, segment.index)
            self.rewrites.append({"request": self.requests, "segment": segment.index, "shared_messages": shared,
                                  "reason": reason})
        self.segments.append(segment)
        return segment

    def record(self, segment: Segment, result: GenerateResult, request: ChatRequest) -> Turn:
        """Append a model turn's ids (cut at a ``stop`` string) and build the reply the harness
        gets; BadRequest, with nothing appended, when the reply does not satisfy the request
        (tool choice, response format)."""
        ledger = segment.ledger
        decode = ledger.codec.decode
        prompt_tokens = len(ledger.ids)
        end = reply_end(result.token_ids.tolist(), result.finish_reason, ledger.eot_id, self.special_ids)
        result, stop_at = cut_at_stop(result, request.stop, end, decode)
        ids = result.token_ids.tolist()
        end = min(end, len(ids))
        text = decode(ids[:end])
        finished = result.finish_reason == "stop"
        content, calls = request.tool_choice.reply(text if stop_at is None else text[:stop_at], finished=finished)
        if finished and not calls:
            request.response_format.check(content)
        ledger.add_turn(result)
        message = ChatMessage("assistant", content, calls)
        segment.known.append(message)
        segment.turns += 1
        segment.last_turn_at = next(self._turn_seq)
        finish = "length" if result.finish_reason == "length" else ("tool_calls" if calls else "stop")
        stop = None if stop_at is None else next(s for s in request.stop if text.startswith(s, stop_at))
        return Turn(message, finish, prompt_tokens, result, end, stop)

    @property
    def rewritten(self) -> bool:
        return bool(self.rewrites)

    def outcome(self, *, finish_reason: str, keep: str = "all", metrics: dict[str, Any] | None = None) -> AgentOutcome:
        """The trajectory's arrays (see the module's docstring for what they hold)."""
        if keep not in KEEP_MODES:
            raise ConfigError(f"keep must be one of {KEEP_MODES}, got {keep!r}")
        used = [s for s in self.segments if s.turns]
        if keep == "last" and used:
            used = [max(used, key=lambda s: s.last_turn_at)]
        parts = [(s, s.ledger.outcome(finish_reason=finish_reason)) for s in used]
        info = [{"index": s.index, "reason": s.reason, "first_request": s.first_request, "turns": s.turns,
                 "prompt_tokens": len(s.ledger.prompt_ids), "response_tokens": s.ledger.response_len,
                 "in_arrays": any(s is p for p, _ in parts)} for s in self.segments]
        all_metrics = {**self.content.metrics(), **(metrics or {}), "history_rewritten": self.rewritten,
                       "history_segments": info, "history_rewrites": list(self.rewrites), "requests": self.requests,
                       "template_unextendable": self.template_unextendable}
        if not parts:
            empty = np.zeros(0, dtype=np.int32)
            prompt = self.segments[0].ledger.prompt_ids.copy() if self.segments else empty
            return AgentOutcome(prompt_ids=prompt, response_ids=empty, response_mask=np.zeros(0, dtype=np.uint8),
                                response_logprobs=np.zeros(0, dtype=np.float32), finish_reason=finish_reason,
                                num_turns=0, template_append_only=not self.rewritten, metrics=all_metrics)
        ids, mask, lps, turns, ranges, notes = [], [], [], [], [], []
        offset = 0
        for k, (segment, o) in enumerate(parts):
            start = offset
            if k:
                # A later segment carries its own prompt: its range is a history of its own.
                ids.append(o.prompt_ids)
                mask.append(np.zeros(len(o.prompt_ids), dtype=np.uint8))
                lps.append(np.zeros(len(o.prompt_ids), dtype=np.float32))
                offset += len(o.prompt_ids)
            ids.append(o.response_ids)
            mask.append(o.response_mask)
            lps.append(o.response_logprobs)
            turns += [dataclasses.replace(t, start=t.start + offset, end=t.end + offset)
                      for t in o.turns]
            offset += len(o.response_ids)
            ranges.append((start, offset))
            notes += [f"segment {segment.index}: {n}" for n in o.template_notes]
        last = parts[-1][1]
        notes += [r["reason"] for r in self.rewrites]
        if self.template_unextendable is not None:
            notes.append(f"the chat template cannot append observations token by token: {self.template_unextendable}")
        return AgentOutcome(
            prompt_ids=parts[0][1].prompt_ids, response_ids=np.concatenate(ids), response_mask=np.concatenate(mask),
            response_logprobs=np.concatenate(lps), finish_reason=finish_reason, num_turns=len(turns), turns=turns,
            template_append_only=len(parts) == 1 and all(o.template_append_only for _, o in parts),
            segments=ranges, submitted=finish_reason == "completed", messages=last.messages, template_notes=notes,
            metrics=all_metrics)
