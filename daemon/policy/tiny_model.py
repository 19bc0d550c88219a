"""A small Qwen2 model with seeded random weights on the bundled tokenizer.

Nothing can be downloaded on the machines rolloutd is tested on, so real vLLM serves this model
there: a real architecture and real weights (random, so its rewards are 0), small enough for the
CPU. ``head_dim`` stays 64, the least vLLM's CPU attention accepts. Building it needs torch and
transformers; :func:`ensure_tiny_model` runs the build in the vLLM environment when this one
lacks them, and caches the folder by its parameters.

    python -m rolloutd.daemon.policy.tiny_model DEST [--seed N] [--hidden N] [--layers N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from rolloutd.daemon.policy.tokenizer import DEFAULT_TOKENIZER_DIR, VOCAB_SIZE
from rolloutd.native_io.errors import ConfigError
from rolloutd.native_io.output import LOG_TAIL_CHARS, tail

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
HEAD_DIM = 64
IM_END_ID = 2
ENDOFTEXT_ID = 0


@dataclass(frozen=True)
class TinyModelSpec:
    seed: int = 0
    hidden: int = 128
    """Hidden size; a multiple of 64 (one attention head per 64)."""
    layers: int = 2
    intermediate: int = 256
    max_positions: int = 32768
    tied: bool = True
    """Tied input and output embeddings (the case vLLM's CPU reload gets wrong without our repack)."""

    def __post_init__(self) -> None:
        if self.hidden < HEAD_DIM or self.hidden % HEAD_DIM:
            raise ConfigError(f"tiny model hidden must be a multiple of {HEAD_DIM}, got {self.hidden}")

    @property
    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def build_tiny_model(dest: Path, spec: TinyModelSpec) -> Path:
    """Write the model and the bundled tokenizer to ``dest`` (needs torch and transformers)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    heads = spec.hidden // HEAD_DIM
    config = Qwen2Config(
        vocab_size=VOCAB_SIZE, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers, num_attention_heads=heads, num_key_value_heads=1,
        head_dim=HEAD_DIM, max_position_embeddings=spec.max_positions, tie_word_embeddings=spec.tied,
        eos_token_id=IM_END_ID, pad_token_id=ENDOFTEXT_ID, bos_token_id=None, torch_dtype="float32")
    torch.manual_seed(spec.seed)
    model = Qwen2ForCausalLM(config).to(torch.float32)
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(DEFAULT_TOKENIZER_DIR / name, tmp / name)
    (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": [IM_END_ID, ENDOFTEXT_ID]}))
    for path in tmp.iterdir():  # save_pretrained writes 0600; the tests read it as another user too
        path.chmod(0o644)
    tmp.rename(dest)
    return dest


def ensure_tiny_model(cache_dir: Path, spec: TinyModelSpec = TinyModelSpec(), *, python: str | None = None) -> Path:
    """The cached model folder for ``spec``, built once with ``python`` (default: this one)."""
    dest = cache_dir / "models" / f"tiny-qwen2-{spec.key}"
    if (dest / "config.json").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    cmd = [python or sys.executable, "-m", __name__, str(dest), "--seed", str(spec.seed), "--hidden",
           str(spec.hidden), "--layers", str(spec.layers), "--intermediate", str(spec.intermediate)]
    if not spec.tied:
        cmd.append("--untied")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0 or not (dest / "config.json").exists():
        raise ConfigError(f"building the tiny test model failed ({' '.join(cmd)}): {tail(done.stderr, LOG_TAIL_CHARS)}")
    return dest


class Recompute:
    """The trainer-side check: the model's log-probability of each token, computed by
    transformers on the same weights (float32, CPU; needs torch and transformers)."""

    def __init__(self, model_dir: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self._torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()

    def token_logprobs(self, prompt: list[int], generated: list[int]) -> np.ndarray:
        """log p(generated[i] | prompt + generated[:i]) for every i."""
        torch = self._torch
        ids = torch.tensor([list(prompt) + list(generated)])
        with torch.no_grad():
            logits = self.model(ids).logits[0, len(prompt) - 1:-1].float()
        lp = torch.log_softmax(logits, dim=-1)
        return lp.gather(1, torch.tensor(list(generated))[:, None])[:, 0].numpy()

    def max_error(self, prompt: list[int], generated: np.ndarray, logprobs: np.ndarray) -> float:
        if len(generated) == 0:
            return 0.0
        return float(np.abs(self.token_logprobs(prompt, generated.tolist()) - logprobs).max())

    def load(self, model_dir: Path) -> None:
        """Use the weights in ``model_dir`` from now on (after a push)."""
        self.__init__(model_dir)  # type: ignore[misc]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--intermediate", type=int, default=256)
    parser.add_argument("--untied", action="store_true")
    args = parser.parse_args(argv)
    spec = TinyModelSpec(seed=args.seed, hidden=args.hidden, layers=args.layers,
                         intermediate=args.intermediate, tied=not args.untied)
    if not args.dest.exists():
        build_tiny_model(args.dest, spec)
    print(args.dest)


if __name__ == "__main__":
    main()
