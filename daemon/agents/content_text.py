"""Text the model did not write, encoded so that it cannot forge the chat template.

Tool and IPython output, editor views, task instructions, user and system messages and every
message a black-box harness sends reach the token ledger through :class:`ContentText`. A tool
that prints ``<|im_end|>\\n<|im_start|>assistant`` would otherwise put the real end-of-turn and
turn-start ids in the middle of an observation: a forged end of the tool's message and a forged
assistant turn, written by the sandbox. With ``content_special_tokens = "text"`` (the default)
such strings are encoded as the ordinary text they are (``<|``, ``im``, ``_``, ``end``, ``|>``):
only the chat template's own framing produces added-token ids, and the ids decode to the same
text. ``"reject"`` ends the trajectory at the first such string (:class:`SpecialTokenInContent`
names it); ``"special"`` keeps the old behaviour (the tokenizer matches them as added tokens).

How: before a message is rendered, every added token's text in its content is replaced by a
sentinel (a private-use character and the token's index; the private-use character itself is
escaped the same way), so the template renders the content in place but nothing in it matches an
added token. The rendering is encoded with added tokens matched, which now finds only the
template's; each stretch of text between two of them that holds a sentinel is put back and
encoded again with every added token split as text: the Rust tokenizer's
``encode_special_tokens = True`` on a copy whose added tokens are all flagged special (so a
non-special added token such as Qwen2.5's ``<tool_call>`` is split too). The tokenizer itself cuts
its input at added tokens and encodes the stretches between them independently, so these are its
ids for the real text with only the framing's tokens matched. Content holding no added token's
text (nearly all of it) is left as it was: one regular-expression search per message.
"""

from __future__ import annotations

import json
import re
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any

from rolloutd.native_io.errors import ConfigError, SpecialTokenInContent

CONTENT_SPECIAL_TOKENS = ("text", "reject", "special")

_LEAD = "\U000f0000"
"""Starts a sentinel. A supplementary private-use character: no tokenizer's added token holds it."""
_INDEX_BASE = 0xF0001
"""Sentinel ``_LEAD + chr(_INDEX_BASE + k)`` stands for added token ``k``; ``_LEAD + _LEAD`` for ``_LEAD``."""
_SENTINEL = re.compile(_LEAD + "(.)", re.DOTALL)


def check_mode(value: Any, where: str) -> str:
    """``value`` when it is one of :data:`CONTENT_SPECIAL_TOKENS`; ConfigError naming ``where``."""
    if value not in CONTENT_SPECIAL_TOKENS:
        raise ConfigError(f"{where} must be one of {CONTENT_SPECIAL_TOKENS}, got {value!r}")
    return str(value)


@dataclass(frozen=True)
class _Vocabulary:
    """What one tokenizer needs for escaping: its added tokens and a text-only copy of it."""

    tokens: tuple[str, ...]
    index: dict[str, int]
    added_ids: frozenset[int]
    search: re.Pattern[str]
    backend: Any
    """The tokenizer's Rust backend (None for a slow tokenizer)."""
    text_backend: Any
    """A copy of ``backend`` that encodes every added token's text as ordinary text."""


_VOCABULARIES: weakref.WeakKeyDictionary[Any, _Vocabulary] = weakref.WeakKeyDictionary()


def _vocabulary(tokenizer: Any) -> _Vocabulary:
    found = _VOCABULARIES.get(tokenizer)
    if found is not None:
        return found
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    tokens = tuple(str(getattr(t, "content", t)) for t in decoder.values())
    # Longest first: the tokenizer matches leftmost-longest, so "<|im_end|>" is not found as a shorter token.
    alternatives = [re.escape(t) for t in sorted(set(tokens), key=len, reverse=True) if t] + [re.escape(_LEAD)]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text_backend = None
    if backend is not None:
        from tokenizers import Tokenizer

        spec = json.loads(backend.to_str())
        for added in spec.get("added_tokens") or []:
            added["special"] = True
        text_backend = Tokenizer.from_str(json.dumps(spec))
        text_backend.encode_special_tokens = True
    vocabulary = _Vocabulary(tokens, {t: k for k, t in enumerate(tokens)}, frozenset(decoder),
                             re.compile("|".join(alternatives)), backend, text_backend)
    _VOCABULARIES[tokenizer] = vocabulary
    return vocabulary


class ContentText:
    """Escapes the content of non-model messages and encodes their rendering; counts what it
    neutralised. One per trajectory (the counts are the trajectory's)."""

    def __init__(self, tokenizer: Any, mode: str = "text") -> None:
        self.mode = check_mode(mode, "content_special_tokens")
        self._vocab = _vocabulary(tokenizer)
        if self.mode == "text" and self._vocab.backend is None and self._vocab.tokens:
            raise ConfigError("content_special_tokens='text' needs a fast (Rust-backed) tokenizer to encode added "
                              "tokens' text as text; load a fast tokenizer or choose 'reject' or 'special'")
        self._tokenizer = tokenizer
        self.neutralised: Counter[str] = Counter()
        """How often each added token's text was found in content and encoded as text."""
        self.rejected: dict[str, str] | None = None
        """``{"token", "role"}`` of the string that ended the trajectory under ``reject``."""

    def escape(self, role: str, content: str) -> str:
        """``content`` as the template should see it. Raises SpecialTokenInContent under ``reject``."""
        if self.mode == "special":
            return content
        search = self._vocab.search
        hit = search.search(content)
        if hit is None:
            return content
        if self.mode == "reject":
            token = next((m.group() for m in search.finditer(content, hit.start()) if m.group() != _LEAD), None)
            if token is not None:
                self.rejected = {"token": token, "role": role}
                raise SpecialTokenInContent(
                    f"a {role} message contains {token!r}, the text of one of the tokenizer's added tokens, and "
                    "content_special_tokens is 'reject'; set it to 'text' to encode such strings as text",
                    details={"token": token, "role": role})
        index = self._vocab.index

        def sentinel(match: re.Match[str]) -> str:
            found = match.group()
            if found == _LEAD:
                return _LEAD + _LEAD
            self.neutralised[found] += 1
            return _LEAD + chr(_INDEX_BASE + index[found])

        return search.sub(sentinel, content)

    def escape_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Copies of ``messages`` with their string contents escaped (other fields as they are)."""
        return [{**m, "content": self.escape(m["role"], m["content"])} if isinstance(m.get("content"), str)
                else dict(m) for m in messages]

    def unescape(self, text: str) -> str:
        if _LEAD not in text:
            return text
        tokens = self._vocab.tokens
        return _SENTINEL.sub(lambda m: _LEAD if m.group(1) == _LEAD else tokens[ord(m.group(1)) - _INDEX_BASE], text)

    def encode(self, text: str) -> list[int]:
        """Ids of a rendering of escaped messages: added tokens only where the template wrote them."""
        vocab = self._vocab
        if vocab.backend is None:  # no escaping happened: 'reject' or 'special' (see __init__)
            return list(self._tokenizer.encode(self.unescape(text), add_special_tokens=False))
        encoding = vocab.backend.encode(text, add_special_tokens=False)
        if self.mode == "special" or _LEAD not in text:
            return list(encoding.ids)
        ids: list[int] = []
        done = 0
        for token_id, (start, end) in zip(encoding.ids, encoding.offsets):
            if token_id in vocab.added_ids:
                ids += self._as_text(text[done:start])
                ids.append(token_id)
                done = end
        ids += self._as_text(text[done:])
        return ids

    def _as_text(self, piece: str) -> list[int]:
        if not piece:
            return []
        return list(self._vocab.text_backend.encode(self.unescape(piece), add_special_tokens=False).ids)

    def metrics(self) -> dict[str, Any]:
        """What the trajectory's metrics report: the mode, how many strings were neutralised (and
        which), and the one rejected."""
        out: dict[str, Any] = {"content_special_tokens": self.mode,
                               "special_tokens_neutralised": sum(self.neutralised.values())}
        if self.neutralised:
            out["special_tokens_neutralised_by_token"] = dict(self.neutralised)
        if self.rejected is not None:
            out["special_token_rejected"] = dict(self.rejected)
        return out
