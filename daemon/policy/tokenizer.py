"""The reference policy's tokenizer: a byte-level BPE shipped in Hugging Face format.

The daemon loads it with ``transformers.AutoTokenizer.from_pretrained`` (:func:`load_tokenizer`),
the same code path as Qwen or Llama. The policy server itself only needs ids and the raw BPE,
so it reads ``tokenizer.json`` with the lighter ``tokenizers`` library (:func:`load_raw_tokenizer`);
both read the same file, so they agree on every id.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer

from rolloutd.native_io.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
DEFAULT_TOKENIZER_DIR = ASSETS_DIR / "tokenizer"
STRIP_THINK_TEMPLATE_PATH = DEFAULT_TOKENIZER_DIR / "chat_template_strip_think.jinja"
VOCAB_SIZE = 2048

EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)


@dataclass(frozen=True)
class SpecialIds:
    endoftext: int
    im_start: int
    im_end: int

    @property
    def stop(self) -> frozenset[int]:
        """Ids that end a generation (finish reason ``stop``)."""
        return frozenset({self.im_end, self.endoftext})


def load_tokenizer(path: str | Path | None = None) -> PreTrainedTokenizerBase:
    """The HF fast tokenizer in ``path`` (default: the reference tokenizer shipped with rolloutd).

    Loaded as ``PreTrainedTokenizerFast`` (tokenizer.json, special tokens, chat template), the
    class Qwen's and Llama's fast tokenizers derive from, not through ``AutoTokenizer``: that path
    imports the model configuration code and, with it, torch, which would add ~200 MB to every
    worker (and to the cost of each fork it makes) and seconds to its start-up."""
    from transformers import PreTrainedTokenizerFast

    folder = Path(path) if path is not None else DEFAULT_TOKENIZER_DIR
    if not (folder / "tokenizer.json").exists():
        raise ConfigError(f"no tokenizer.json in {folder}; pass the folder of a Hugging Face (fast) tokenizer")
    return PreTrainedTokenizerFast.from_pretrained(str(folder))


def load_raw_tokenizer(path: str | Path | None = None) -> Tokenizer:
    folder = Path(path) if path is not None else DEFAULT_TOKENIZER_DIR
    file = folder / "tokenizer.json"
    if not file.exists():
        raise ConfigError(f"no tokenizer.json in {folder}; pass the folder of a Hugging Face tokenizer")
    return Tokenizer.from_file(str(file))


def special_ids(tok: Tokenizer) -> SpecialIds:
    found = {name: tok.token_to_id(name) for name in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    ids = {name: i for name, i in found.items() if i is not None}
    if len(ids) < len(found):
        missing = sorted(set(found) - set(ids))
        raise ConfigError(f"tokenizer lacks the special tokens {missing}; re-train it with train_tokenizer")
    return SpecialIds(endoftext=ids["<|endoftext|>"], im_start=ids["<|im_start|>"], im_end=ids["<|im_end|>"])
