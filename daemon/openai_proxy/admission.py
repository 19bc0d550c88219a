"""The size check a request passes before any rendering or encoding: a conversation that cannot
fit ``max_context_tokens`` is refused without the work that would find it out the slow way.

Two bounds on the tokens the request's texts take in any segment:

1. bytes: no token stands for more bytes than the longest one in the vocabulary, so a request
   whose texts hold more than ``max_context_tokens x longest`` bytes cannot fit. Costs a length.
2. a count, for requests over :data:`COUNT_ABOVE_BYTES`: the texts cut into pieces of about
   :data:`PIECE_BYTES` at whitespace, encoded through the Rust tokenizer's batch call (which
   releases the GIL) in a worker thread, a batch at a time, until the pieces so far show the
   request cannot fit: a huge message is refused after encoding about one context's worth of
   it, not all of it, and the node's event loop and its other sessions go on meanwhile. A piece
   can tokenize differently from the same text inside the rendering only near its two cuts
   (the template's framing, the neighbouring pieces), so each piece counts
   :data:`MARGIN_TOKENS` less than it encodes to.

What passes is at most about ``max_context_tokens`` of text: its rendering and encoding (run off
the event loop by the session) cost what one full context costs, whatever the request's size.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

from rolloutd.native_io.errors import BadRequest

from .protocol import ChatRequest

COUNT_ABOVE_BYTES = 256 * 1024
"""Requests with more text than this are counted (2) before any render."""
PIECE_BYTES = 16 * 1024
BATCH_PIECES = 8
"""Pieces encoded per thread call (the Rust tokenizer spreads a batch over its threads)."""
MARGIN_TOKENS = 16
"""Tokens a piece may take fewer of inside the rendering than alone (8 at each cut)."""

_LONGEST: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


def longest_token_bytes(tokenizer: Any) -> int:
    """An upper bound on the bytes one token stands for: the longest vocabulary entry, in
    characters for a byte-level BPE (one character per byte), else in UTF-8 (a SentencePiece
    piece holds at least as many bytes as its text, a byte fallback ``<0xE2>`` six for one)."""
    if tokenizer not in _LONGEST:
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        byte_level = type(decoder).__name__ == "ByteLevel"
        _LONGEST[tokenizer] = max(len(piece) if byte_level else len(piece.encode()) for piece in tokenizer.get_vocab())
    return _LONGEST[tokenizer]


def request_texts(request: ChatRequest) -> list[str]:
    """Every text of the request the template renders: contents and tool-call arguments."""
    texts = [m.content for m in request.messages if m.content]
    texts += [c.arguments for m in request.messages for c in m.tool_calls]
    return texts


def context_exceeded(message: str) -> BadRequest:
    return BadRequest(message + "; the trajectory ends here (raise the agent's max_context_tokens for longer ones)",
                      details={"code": "context_length_exceeded", "param": "messages"})


async def check_size(request: ChatRequest, tokenizer: Any, max_context_tokens: int) -> None:
    """BadRequest (``context_length_exceeded``) when the request's messages cannot fit."""
    texts = request_texts(request)
    size = sum(len(t.encode()) for t in texts)
    longest = longest_token_bytes(tokenizer)
    if size > max_context_tokens * longest:
        raise context_exceeded(f"the messages hold {size} bytes of text, more than max_context_tokens="
                               f"{max_context_tokens} tokens of at most {longest} bytes each can")
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if size <= COUNT_ABOVE_BYTES or backend is None:
        return
    pieces = [piece for text in texts for piece in _pieces(text)]
    at_least = 0
    for start in range(0, len(pieces), BATCH_PIECES):
        batch = pieces[start:start + BATCH_PIECES]
        encodings = await asyncio.to_thread(backend.encode_batch, batch, add_special_tokens=False)
        at_least += sum(max(0, len(e.ids) - MARGIN_TOKENS) for e in encodings)
        if at_least >= max_context_tokens:
            raise context_exceeded(f"the messages are more than {at_least} tokens, not below max_context_tokens="
                                   f"{max_context_tokens}")


def _pieces(text: str) -> list[str]:
    """``text`` cut into pieces of about PIECE_BYTES characters, each cut at a whitespace
    character where one is near (the pre-tokenizers of byte-level BPE split there too)."""
    out, start = [], 0
    while len(text) - start > PIECE_BYTES:
        cut = start + PIECE_BYTES
        space = max(text.rfind(" ", cut - PIECE_BYTES // 4, cut), text.rfind("\n", cut - PIECE_BYTES // 4, cut))
        cut = space if space > start else cut
        out.append(text[start:cut])
        start = cut
    out.append(text[start:])
    return out
