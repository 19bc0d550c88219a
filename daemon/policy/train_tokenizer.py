"""Re-train the reference policy's tokenizer from the corpus that ships with the project.

    python -m rolloutd.daemon.policy.train_tokenizer [--out DIR]

A byte-level BPE (the scheme of Qwen, Llama 3 and GPT-2) trained with ``tokenizers`` on
``assets/corpus/*.txt``, saved in Hugging Face format (``tokenizer.json``,
``tokenizer_config.json`` with the ChatML chat template, ``special_tokens_map.json``) so that
``transformers.AutoTokenizer.from_pretrained`` loads it exactly like a real model's tokenizer.
Training is deterministic: the same corpus gives the same files. The trained files are committed;
re-run this only after changing the corpus or the special tokens (the reference model's
weights are indexed by token id, so a new vocabulary changes what the default model says).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from rolloutd.daemon.policy.tokenizer import (
    ASSETS_DIR,
    DEFAULT_TOKENIZER_DIR,
    EOS_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
)

logger = logging.getLogger(__name__)

CORPUS_DIR = ASSETS_DIR / "corpus"
DEFAULT_TEMPLATE_PATH = ASSETS_DIR / "templates" / "chatml_tools.jinja"


def train(corpus_files: list[Path], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(p) for p in corpus_files], trainer)
    return tok


def tokenizer_config(tok: Tokenizer, chat_template: str) -> dict[str, object]:
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [t for t in SPECIAL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)],
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 32768,
        "split_special_tokens": False,
        "chat_template": chat_template,
    }


def save(tok: Tokenizer, out_dir: Path, chat_template: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = tokenizer_config(tok, chat_template)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    special_map = {
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": config["additional_special_tokens"],
    }
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_TOKENIZER_DIR, help="output folder")
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    corpus = sorted(CORPUS_DIR.glob("*.txt"))
    tok = train(corpus, args.vocab_size)
    save(tok, args.out, DEFAULT_TEMPLATE_PATH.read_text())
    logger.info("trained on %d files (%d bytes); vocab %d; wrote %s", len(corpus),
                sum(p.stat().st_size for p in corpus), tok.get_vocab_size(), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
