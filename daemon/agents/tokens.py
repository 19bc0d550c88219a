"""The token ledger of one multi-turn trajectory: token ids in, token ids out, nothing re-encoded.

How the sequence grows::

    prompt_ids  = encode(render([system, user], generation prompt))         once
    turn        = the server's ids, appended as they are                     mask 1, logprobs kept
    close       = <end-of-turn> when the turn did not end with it            mask 0
    observation = encode(separator + framed message + generation prompt)     mask 0

Every message's content passes through :class:`~.content_text.ContentText` on the way in: text
that looks like an added token (``<|im_end|>`` printed by a tool) is encoded as text, so only the
template's framing produces added-token ids (see that module).

``separator`` is what the template writes after an end-of-turn token (``"\\n"`` for ChatML): the
model's turn stops AT its end-of-turn token, so the separator opens the next message. The framing
around a message's content is taken once from the template by rendering a fixed base conversation
(the trajectory's own system and user messages) and a closed assistant turn plus a message
holding a placeholder; later observations are that framing around their content, so a turn costs
a few string joins and one encode of the new text, never a render of the history. A template
that does not insert content verbatim (e.g. trims it), or renders a message's ``name`` or
``tool_call_id``, falls back to rendering base + turn + message per observation; consecutive
messages are rendered together (Qwen2.5 groups tool results into one user turn).

The framing is learned once per tokenizer, tool list and base roles, from a base conversation
whose contents are markers (a jinja render costs ~1 ms, and learning takes six). Each trajectory
renders its real prompt once and uses the learned framing only if the prompt is exactly the
markers' rendering with its contents put in; otherwise it learns its own.

Generated ids are decoded only to parse the tool call and to keep the transcript. Each observation
starts right after an end-of-turn token (an added token, which the tokenizer matches before BPE),
so it encodes exactly as it would inside the whole rendered transcript; the model's own ids stay
as sampled even where encoding its text afresh would split it differently. Whether the template is
append-only (Qwen3-style templates drop earlier ``<think>`` blocks once a new user message arrives)
is checked by rendering the transcript, after every turn or once at the end (``template_check``);
a divergence is reported (``template_append_only=False``, a new segment where it happened), never
repaired by re-tokenizing.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
from rolloutd.daemon.inference.base import GenerateResult
from rolloutd.daemon.inference.growing_ids import GrowingIds
from rolloutd.native_io.errors import AgentError, ConfigError
from rolloutd.native_io.trajectory import ToolStats, TurnRecord

from .base import TEMPLATE_CHECKS, AgentOutcome
from .codec import TokenCodec
from .content_text import ContentText

log = logging.getLogger(__name__)

# Whitespace around the marker: a template that strips or trims content would change them, which
# sends that role down the render-per-observation path instead of a wrong framing.
_PLACEHOLDERS = (" \n\x1frolloutd-content-a\x1f\n ", "\t\x1frolloutd-content-b\x1f \n")

Message = dict[str, str]

_HEAD_CACHE_SIZE = 16
"""System messages whose ids a shared framing keeps, the most recently used (about one per agent
configuration in use)."""


class ChatFraming:
    """What a chat template writes around messages, learned from a base conversation (or taken
    from ``shape``, a framing learned on markers; see :func:`framing_for`)."""

    def __init__(self, tokenizer: Any, base: list[Message], tools: list[dict[str, Any]] | None,
                 codec: TokenCodec, *, shape: ChatFraming | None = None) -> None:
        self._tokenizer = tokenizer
        self._tools = tools
        self.base = [dict(m) for m in base]
        self.prompt_text = self.render(self.base, generation_prompt=True)
        if shape is not None:
            self._take_shape(shape)
            return
        self._shape = self
        self.base_text = self.render(self.base, generation_prompt=False)
        if not self.prompt_text.startswith(self.base_text):
            raise ConfigError("the chat template's generation prompt does not extend the conversation; "
                              "rolloutd needs a template that appends '<assistant header>' for add_generation_prompt")
        self.generation_prompt = self.prompt_text[len(self.base_text):]
        marker = _PLACEHOLDERS[0]
        closed = self.render([*self.base, {"role": "assistant", "content": marker}], generation_prompt=False)
        head = self.prompt_text + marker
        if not closed.startswith(head):
            raise ConfigError("the chat template does not render an assistant message as generation prompt + "
                              "content; token-in/token-out needs the model's text kept verbatim")
        closing = closed[len(head):]
        closing_ids = codec.encode(closing)
        # Added tokens are matched before BPE runs, so text on either side of one encodes alone.
        atomic = set(getattr(tokenizer, "all_special_ids", ()) or ()) | set(getattr(tokenizer, "added_tokens_decoder", {}))
        if not closing_ids or closing_ids[0] not in atomic:
            raise ConfigError(f"the chat template ends an assistant turn with {closing!r}, which does not start "
                              "with a special end-of-turn token")
        self.eot_id = closing_ids[0]
        self.eot_text = codec.decode([self.eot_id])
        if not closing.startswith(self.eot_text) or not self.base_text.endswith(closing):
            raise ConfigError(f"the chat template closes assistant turns with {closing!r} but the base "
                              "conversation differently; cannot split observations at the end-of-turn token")
        self.separator = closing[len(self.eot_text):]
        self._frames: dict[tuple[str, ...], tuple[str, str] | None] = {}
        self._head_ids: dict[str, np.ndarray] = {}
        # With lstrip, rstrip or single_word, whether the token matches (and what it swallows)
        # depends on the text around it, so the text on one side does not encode alone.
        token = (getattr(tokenizer, "added_tokens_decoder", None) or {}).get(self.eot_id)
        self._split_exact = not any(getattr(token, flag, False) for flag in ("lstrip", "rstrip", "single_word"))

    def _take_shape(self, shape: ChatFraming) -> None:
        expected = shape.prompt_text
        for marker, message in zip(_base_markers(len(self.base)), self.base):
            expected = expected.replace(marker, message["content"])
        if expected != self.prompt_text:
            raise _ShapeMismatch()
        self._shape = shape
        self.generation_prompt = shape.generation_prompt
        self.base_text = self.prompt_text[:len(self.prompt_text) - len(self.generation_prompt)]
        self.eot_id, self.eot_text, self.separator = shape.eot_id, shape.eot_text, shape.separator

    def render(self, messages: list[Message], *, generation_prompt: bool) -> str:
        try:
            text = self._tokenizer.apply_chat_template(messages, tools=self._tools, tokenize=False,
                                                       add_generation_prompt=generation_prompt)
        except Exception as e:  # jinja raises its own errors (raise_exception, undefined names)
            raise ConfigError(f"the chat template failed to render the conversation: {type(e).__name__}: {e}") from e
        if not isinstance(text, str):
            raise ConfigError(f"apply_chat_template(tokenize=False) returned {type(text).__name__}, not text")
        return text

    def encode_prompt(self, codec: TokenCodec | ContentText) -> list[int]:
        """``codec.encode(prompt_text)``. A framing shared through :func:`framing_for` keeps the
        ids of the text before the first end-of-turn token: the system message and tool list,
        most of a prompt and the same for every rollout of an agent. The end-of-turn token is an
        added token, matched before BPE, so the text on either side encodes alone; the first
        prompt with a new head is encoded whole as well and compared, and one mismatch turns the
        split off for the shape."""
        shape = self._shape
        head, eot, rest = self.prompt_text.partition(self.eot_text)
        if shape is self or not shape._split_exact or not eot:
            return codec.encode(self.prompt_text)
        cache = shape._head_ids
        head_ids = cache.pop(head, None)
        if head_ids is None:
            whole = codec.encode(self.prompt_text)
            parts = codec.encode(head)
            if whole != [*parts, self.eot_id, *codec.encode(rest)]:
                log.warning("the tokenizer encodes prompts differently when split at the end-of-turn token; "
                            "encoding them whole")
                shape._split_exact = False
                cache.clear()
                return whole
            if len(cache) >= _HEAD_CACHE_SIZE:
                del cache[next(iter(cache))]
            cache[head] = np.asarray(parts, dtype=np.int32)
            return whole
        cache[head] = head_ids  # back in as the most recently used
        return [*head_ids.tolist(), self.eot_id, *codec.encode(rest)]

    def _delta(self, messages: list[Message]) -> str:
        """Text the template adds for ``messages`` (+ generation prompt) after the base and a closed
        assistant turn, separator first. Observations always follow a model turn: without one, a
        template that groups consecutive tool results (Qwen2.5) would merge them with a base that
        ends in tool results. The turn is a placeholder: the model's real text could hold a
        ``<think>`` block that a Qwen3-style template drops once a user message follows, which the
        template check reports where it happens."""
        before = [*self.base, {"role": "assistant", "content": _PLACEHOLDERS[0]}]
        closed = self.render(before, generation_prompt=False)
        rendered = self.render([*before, *messages], generation_prompt=True)
        if not rendered.startswith(closed) or not closed.endswith(self.separator):
            raise ConfigError(f"adding a {messages[0]['role']!r} message makes the chat template re-render the "
                              "conversation before it; observations cannot be appended token by token")
        return rendered[len(closed) - len(self.separator):]

    def _frame(self, role: str, extra: tuple[str, ...] = ()) -> tuple[str, str] | None:
        """(text before, text after) the content of a ``role`` message carrying the fields
        ``extra`` (``name``, ``tool_call_id``), or None when that message must be rendered: its
        content is not inserted verbatim, or the template renders one of those fields."""
        if self._shape is not self:
            return self._shape._frame(role, extra)
        key = (role, *extra)
        if key not in self._frames:
            found: list[tuple[str, str]] = []
            fields = {name: f"rolloutd{name}Marker" for name in extra}
            for marker in _PLACEHOLDERS:
                pre, hit, post = self._delta([{"role": role, "content": marker, **fields}]).partition(marker)
                if hit and not any(value in pre + post for value in fields.values()):
                    found.append((pre, post))
            verbatim = len(found) == len(_PLACEHOLDERS) and len(set(found)) == 1
            if not verbatim:
                log.info("chat template does not insert %r content verbatim or renders %s; rendering each "
                         "such observation", role, extra or "no other field")
            self._frames[key] = found[0] if verbatim else None
        return self._frames[key]

    def message_text(self, role: str, content: str) -> str:
        """Separator + the framed message + the generation prompt, as the template writes them."""
        return self.messages_text([{"role": role, "content": content}])

    def messages_text(self, messages: list[Message]) -> str:
        """:meth:`message_text` for several messages in a row, rendered together after a model
        turn: some templates frame consecutive messages as one group (Qwen2.5 puts
        consecutive tool results in one turn), others render a tool result's name or call id."""
        if len(messages) == 1:
            extra = tuple(sorted(k for k, v in messages[0].items() if k not in ("role", "content") and v is not None))
            frame = self._frame(messages[0]["role"], extra)
            if frame is not None:
                return frame[0] + messages[0]["content"] + frame[1]
        return self._delta(messages)


class _ShapeMismatch(Exception):
    """The template renders this conversation differently from its markers' rendering."""


def _base_markers(n: int) -> list[str]:
    # Letters and digits only: trim and escape filters leave them as they are (Python counts \x1f
    # as whitespace).
    return [f"rolloutdBase{i}Marker" for i in range(n)]


_SHAPES: weakref.WeakKeyDictionary[Any, dict[tuple[str, tuple[str, ...]], ChatFraming | None]] = weakref.WeakKeyDictionary()


def framing_for(tokenizer: Any, base: list[Message], tools: list[dict[str, Any]] | None,
                codec: TokenCodec) -> ChatFraming:
    """The framing of ``base``: taken from the one learned on markers for the same tokenizer, tools
    and roles when the template renders ``base`` exactly as it renders the markers."""
    key = (json.dumps(tools, sort_keys=True), tuple(m["role"] for m in base))
    shapes = _SHAPES.setdefault(tokenizer, {})
    if key not in shapes:
        markers = [{"role": m["role"], "content": text} for m, text in zip(base, _base_markers(len(base)))]
        try:
            shapes[key] = ChatFraming(tokenizer, markers, tools, codec)
        except ConfigError:  # the real conversation gets its own verdict below
            shapes[key] = None
    shape = shapes[key]
    if shape is not None:
        with contextlib.suppress(_ShapeMismatch):
            return ChatFraming(tokenizer, base, tools, codec, shape=shape)
    return ChatFraming(tokenizer, base, tools, codec)


@dataclass
class _Chunk:
    length: int
    mask: int
    logprobs: np.ndarray | None


class TokenLedger:
    """The growing token sequence of one trajectory and its transcript.

    ``ids`` is the whole sequence (prompt + response) to send to the server for the next turn, a
    :class:`GrowingIds`: it refuses edits, and carries its JSON text for the HTTP backends.
    """

    def __init__(self, tokenizer: Any, base: list[Message], tools: list[dict[str, Any]] | None = None, *,
                 max_total_tokens: int, template_check: str = "final", window: int | None = None,
                 content: ContentText | None = None) -> None:
        """``max_total_tokens`` is the agent's own budget (a prompt that does not fit it is a
        configuration error); ``window`` the server's context window, which may be smaller: a
        sequence that reaches it ends the trajectory with finish reason ``context_length``.
        ``content`` encodes every message's content (default: a fresh one, special tokens as
        text); raises SpecialTokenInContent when it rejects the base messages."""
        if template_check not in TEMPLATE_CHECKS:
            raise ConfigError(f"template_check must be one of {TEMPLATE_CHECKS}, got {template_check!r}")
        self.codec = TokenCodec(tokenizer)
        self.content = content if content is not None else ContentText(tokenizer)
        self.framing = framing_for(tokenizer, self.content.escape_messages(base), tools, self.codec)
        self.template_check = template_check
        self.window_binds = window is not None and window < max_total_tokens
        self.max_total_tokens = min(max_total_tokens, window) if window is not None else max_total_tokens
        self._budget = max_total_tokens
        self.messages: list[Message] = [dict(m) for m in base]
        self._n_base = len(base)
        self.prompt_ids = np.asarray(self.framing.encode_prompt(self.content), dtype=np.int32)
        self.ids = GrowingIds(self.prompt_ids.tolist())
        self._n_prompt = len(self.ids)
        self._chunks: list[_Chunk] = []
        self.turns: list[TurnRecord] = []
        self._msg_start: list[int] = []
        """Response index where each message after the base begins."""
        self._closed = True
        # Template check state: the rendering last verified and how many ids it covered.
        self._rendered = self.content.unescape(self.framing.prompt_text)
        self._checked_ids = 0
        self._checked_msgs = len(self.messages)
        self._diverged = False
        self.boundaries: list[int] = []
        self.notes: list[str] = []
        if template_check == "every_turn" and self.codec.decode(self.ids) != self._rendered:
            self._diverge(0, "the prompt's tokens do not decode to the rendered prompt (the tokenizer does not "
                             "round-trip it)")
        if self._n_prompt >= self._budget:
            raise ConfigError(f"the prompt alone is {self._n_prompt} tokens, not below max_context_tokens="
                              f"{max_total_tokens}; raise max_context_tokens")

    @property
    def response_len(self) -> int:
        return len(self.ids) - self._n_prompt

    @property
    def room(self) -> int:
        """Tokens that may still be added before max_total_tokens (negative when the prompt
        alone is past the server's window)."""
        return self.max_total_tokens - len(self.ids)

    @property
    def full_reason(self) -> str:
        """The finish reason of a trajectory that ran out of room: ``context_length`` where the
        server's window is the limit, else ``max_tokens`` (the agent's budget)."""
        return "context_length" if self.window_binds else "max_tokens"

    @property
    def eot_id(self) -> int:
        return self.framing.eot_id

    def add_turn(self, result: GenerateResult) -> str:
        """Append a model turn's ids unchanged (mask 1); returns its text without the end-of-turn."""
        if self.messages[-1]["role"] == "assistant":
            raise AgentError("two model turns in a row: add the observation of the previous turn first")
        new = result.token_ids.tolist()
        if np.shape(result.logprobs) != (len(new),):
            # numpy would broadcast a shorter array over the turn: log-probabilities of other tokens
            raise AgentError(f"a turn of {len(new)} tokens came with log-probabilities of shape "
                             f"{np.shape(result.logprobs)} from {result.server or 'the server'}; need one per token")
        if len(new) > self.room:
            raise AgentError(f"a turn of {len(new)} tokens does not fit the {self.room} left under "
                             f"max_context_tokens={self.max_total_tokens}; ask for at most room tokens")
        start = self.response_len
        self.ids.extend(new)
        self._chunks.append(_Chunk(len(new), 1, result.logprobs))
        self.turns.append(TurnRecord(start=start, end=start + len(new), weight_version=result.weight_version,
                                     finish_reason=result.finish_reason, server=result.server,
                                     sent_version=result.sent_version, straddled=result.straddled,
                                     weight_spans=[(s.version, s.start, s.end) for s in result.weight_spans]))
        self._closed = bool(new) and new[-1] == self.eot_id
        content = self.codec.decode(new[:-1] if self._closed else new)
        self.messages.append({"role": "assistant", "content": content})
        self._msg_start.append(start)
        return content

    def add_message(self, role: str, content: str) -> bool:
        """Append an observation (``tool``) or a ``user`` message with its framing (mask 0) and the
        generation prompt; False, with nothing appended, when it would pass max_total_tokens."""
        return self.add_messages([{"role": role, "content": content}])

    def add_messages(self, messages: list[Message]) -> bool:
        """:meth:`add_message` for several non-assistant messages in a row (parallel tool results,
        a tool result and a user message), with one generation prompt after the last. Raises
        SpecialTokenInContent, with nothing appended, when ``content`` rejects one."""
        new = self.content.encode(self.framing.messages_text(self.content.escape_messages(messages)))
        close = [] if self._closed else [self.eot_id]
        if len(close) + len(new) > self.room:
            return False
        if close:
            self._append_template(close)
            self._closed = True
        self._msg_start.extend([self.response_len] * len(messages))
        self._append_template(new)
        # Name and call id kept: templates that render them are checked against what they render.
        self.messages.extend(dict(m) for m in messages)
        if self.template_check == "every_turn":
            self._check_new(generation_prompt=True, tail="")
        return True

    def _append_template(self, ids: list[int]) -> None:
        self.ids.extend(ids)
        self._chunks.append(_Chunk(len(ids), 0, None))

    # --- template check -----------------------------------------------------------------------

    def _tail(self) -> tuple[bool, str]:
        """(generation prompt?, text the template adds after the ledger's last token)."""
        if self.messages[-1]["role"] != "assistant":
            return True, ""
        return False, (self.framing.separator if self._closed else self.framing.eot_text + self.framing.separator)

    def _check_new(self, *, generation_prompt: bool, tail: str) -> None:
        """every_turn: the new rendering must extend the last one, by exactly the new tokens' text."""
        rendered = self.framing.render(self.messages, generation_prompt=generation_prompt)
        first_new = self._checked_msgs
        if not rendered.startswith(self._rendered):
            if not self._localize(first_new, len(self.messages)):
                self._diverge(first_new, "the chat template's rendering changed earlier text when messages "
                                         f"{first_new}..{len(self.messages) - 1} were added")
        elif not self._diverged:
            new_text = self.codec.decode(self.ids[self._n_prompt + self._checked_ids:]) + tail
            if rendered[len(self._rendered):] != new_text:
                self._framing_mismatch(rendered, self._rendered + new_text, len(self._rendered))
        self._rendered = rendered
        self._checked_ids = self.response_len
        self._checked_msgs = len(self.messages)

    def _check_final(self) -> None:
        generation_prompt, tail = self._tail()
        rendered = self.framing.render(self.messages, generation_prompt=generation_prompt)
        text = self.codec.decode(self.ids) + tail
        if rendered != text and not self._localize(self._n_base, len(self.messages)):
            self._framing_mismatch(rendered, text, 0)

    def _localize(self, lo: int, hi: int) -> bool:
        """Report each message in [lo, hi) whose addition made the template re-render earlier text;
        False when there is none (renders twice per message; only runs once a check failed)."""
        found = False
        for k in range(max(lo, self._n_base), hi):
            assistant = self.messages[k]["role"] == "assistant"
            before = self.framing.render(self.messages[:k], generation_prompt=assistant)
            after = self.framing.render(self.messages[: k + 1], generation_prompt=not assistant)
            if not after.startswith(before):
                found = True
                at = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
                self._diverge(k, f"adding message {k} ({self.messages[k]['role']}) made the chat template "
                                 f"re-render earlier text from character {at} on: the template is not "
                                 "append-only; the tokens keep what the model saw")
        return found

    def _framing_mismatch(self, rendered: str, ledger_text: str, start: int) -> None:
        """Both texts agree before ``start``; report where they part."""
        at = next((i for i in range(start, min(len(rendered), len(ledger_text))) if rendered[i] != ledger_text[i]),
                  min(len(rendered), len(ledger_text)))
        self._diverge(self._message_at(at), f"the tokens decode to text the template does not produce: from "
                                            f"character {at} the template has {rendered[at:at + 60]!r}, the "
                                            f"tokens {ledger_text[at:at + 60]!r}")

    def _message_at(self, char_offset: int) -> int:
        """Index of the message whose tokens decode to the text at ``char_offset``."""
        end = len(self.codec.decode(self.ids[:self._n_prompt]))
        if char_offset < end:
            return 0
        starts = [*self._msg_start, self.response_len]
        for i in range(len(self._msg_start)):
            end += len(self.codec.decode(self.ids[self._n_prompt + starts[i]:self._n_prompt + starts[i + 1]]))
            if char_offset < end:
                return self._n_base + i
        return len(self.messages) - 1

    def _diverge(self, message_index: int, note: str) -> None:
        self._diverged = True
        self.notes.append(note)
        log.warning("template check: %s", note)
        position = self._msg_start[message_index - self._n_base] if message_index >= self._n_base else 0
        if position not in self.boundaries:
            self.boundaries.append(position)

    # --- result -------------------------------------------------------------------------------

    def outcome(self, *, finish_reason: str, tools: dict[str, ToolStats] | None = None, submitted: bool = False,
                metrics: dict[str, Any] | None = None) -> AgentOutcome:
        """Run the last template check and build the outcome arrays."""
        if self.template_check == "every_turn" and self._checked_msgs < len(self.messages):
            generation_prompt, tail = self._tail()
            self._check_new(generation_prompt=generation_prompt, tail=tail)
        elif self.template_check == "final":
            self._check_final()
        n = self.response_len
        response = np.asarray(self.ids[self._n_prompt:], dtype=np.int32)
        mask = np.zeros(n, dtype=np.uint8)
        logprobs = np.zeros(n, dtype=np.float32)
        pos = 0
        for chunk in self._chunks:
            if chunk.mask:
                mask[pos:pos + chunk.length] = 1
                if chunk.logprobs is not None:
                    logprobs[pos:pos + chunk.length] = chunk.logprobs
            pos += chunk.length
        cuts = sorted(b for b in set(self.boundaries) if 0 < b < n)
        edges = [0, *cuts, n]
        return AgentOutcome(
            prompt_ids=self.prompt_ids.copy(), response_ids=response, response_mask=mask,
            response_logprobs=logprobs, finish_reason=finish_reason, num_turns=len(self.turns),
            turns=list(self.turns), tools=dict(tools or {}), template_append_only=not self._diverged,
            segments=list(itertools.pairwise(edges)), submitted=submitted,
            messages=[dict(m) for m in self.messages], template_notes=list(self.notes),
            metrics={**self.content.metrics(), **(metrics or {})})
