"""Token ids to text and back for one tokenizer, exactly: no special tokens added, nothing cleaned up."""

from __future__ import annotations

from typing import Any


class TokenCodec:
    """encode/decode without special-token insertion or clean-up, through the tokenizer's Rust
    backend when it has one (the Python wrapper adds ~40 us per call)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)

    def encode(self, text: str) -> list[int]:
        if self._backend is not None:
            return list(self._backend.encode(text, add_special_tokens=False).ids)
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return str(self._backend.decode(ids, skip_special_tokens=False))
        return str(self._tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))
