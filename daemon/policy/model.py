"""The reference policy: a small deterministic autoregressive model in numpy.

The forward pass is kept simple so a trainer can port it (e.g. to torch), update the weights and
push them back to the policy server (``/update_weights_from_disk`` with an ``.npz``)::

    V = vocab_size, C = context, D = embed_dim, H = hidden
    ctx(ids, i) = ids[i-C:i], left-padded with pad_id when i < C     # the C tokens before i
    x      = concat(embed[ctx])                                      # [C*D]
    h      = tanh(x @ w1 + b1)                                       # [H]
    logits = h @ w2 + b2                                             # [V]
    log p(ids[i] | ids[:i]) = log_softmax(logits)[ids[i]]

Parameters are float32 arrays named ``embed [V,D]``, ``w1 [C*D,H]``, ``b1 [H]``, ``w2 [H,V]``,
``b2 [V]``. All arithmetic runs in float64 and log-probabilities are reported as float32, so
any two computations of the same token's log-probability agree to float32 rounding whatever the
batch shape. They are raw log-probabilities (before temperature, top-p or top-k), like vLLM's
default ``--logprobs-mode raw_logprobs``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from collections.abc import Sequence

import numpy as np

from rolloutd.native_io.errors import ConfigError

PARAM_NAMES = ("embed", "w1", "b1", "w2", "b2")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int = 2048
    context: int = 4
    """How many preceding tokens the model sees."""
    embed_dim: int = 32
    hidden: int = 64
    pad_id: int = 0
    """Fills the context before the first token (the tokenizer's ``<|endoftext|>``)."""

    def shapes(self) -> dict[str, tuple[int, ...]]:
        v, c, d, h = self.vocab_size, self.context, self.embed_dim, self.hidden
        return {"embed": (v, d), "w1": (c * d, h), "b1": (h,), "w2": (h, v), "b2": (v,)}


class ReferenceModel:
    def __init__(self, params: dict[str, np.ndarray], config: ModelConfig) -> None:
        shapes = config.shapes()
        missing = [n for n in PARAM_NAMES if n not in params]
        if missing:
            raise ConfigError(f"reference model weights lack {missing}; expected {list(PARAM_NAMES)}")
        for name, shape in shapes.items():
            if tuple(params[name].shape) != shape:
                raise ConfigError(
                    f"reference model weight {name} has shape {tuple(params[name].shape)}, "
                    f"expected {shape} for {config}"
                )
        self.config = config
        self._params = {n: np.asarray(params[n], dtype=np.float32) for n in PARAM_NAMES}
        self._f64 = {n: p.astype(np.float64) for n, p in self._params.items()}

    @classmethod
    def init(cls, seed: int = 0, config: ModelConfig | None = None, *, eos_id: int | None = 2,
             eos_bias: float = 4.0) -> ReferenceModel:
        """Weights drawn from ``seed``; ``eos_bias`` raises the logit of ``eos_id`` (the reference
        tokenizer's ``<|im_end|>``, id 2: special tokens are trained first, so their ids are fixed)
        so untrained samples end after a few dozen tokens instead of always hitting max_tokens."""
        config = config or ModelConfig()
        rng = np.random.default_rng(seed)
        shapes = config.shapes()
        params = {
            "embed": rng.standard_normal(shapes["embed"]),
            "w1": rng.standard_normal(shapes["w1"]) / np.sqrt(config.context * config.embed_dim),
            "b1": np.zeros(shapes["b1"]),
            "w2": rng.standard_normal(shapes["w2"]) * 0.4,
            "b2": np.zeros(shapes["b2"]),
        }
        if eos_id is not None:
            params["b2"][eos_id] = eos_bias
        return cls({n: p.astype(np.float32) for n, p in params.items()}, config)

    @classmethod
    def load(cls, path: str | Path) -> ReferenceModel:
        """Weights saved by :meth:`save` (an ``.npz`` with the parameters and ``config``)."""
        try:
            with np.load(path, allow_pickle=False) as data:
                config = ModelConfig(**json.loads(str(data["config"])))
                params = {n: data[n] for n in PARAM_NAMES if n in data}
        except (OSError, KeyError, ValueError, TypeError) as e:
            raise ConfigError(f"cannot load reference model weights from {path}: {e}") from e
        return cls(params, config)

    def save(self, path: str | Path) -> None:
        arrays: dict[str, np.ndarray] = {"config": np.array(json.dumps(asdict(self.config))), **self._params}
        np.savez(path, **arrays)  # type: ignore[arg-type]  # numpy's stub types **kwds too narrowly

    @property
    def params(self) -> dict[str, np.ndarray]:
        """Copies of the float32 parameters."""
        return {n: p.copy() for n, p in self._params.items()}

    def contexts(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """``[len(ids)+1, C]`` int array: row i is the context that predicts ``ids[i]`` (row
        ``len(ids)`` predicts the next token)."""
        c = self.config.context
        padded = np.concatenate([np.full(c, self.config.pad_id, dtype=np.int64), np.asarray(ids, dtype=np.int64)])
        return np.lib.stride_tricks.sliding_window_view(padded, c)

    def logits(self, contexts: np.ndarray) -> np.ndarray:
        """float64 ``[B, V]`` logits for a batch of ``[B, C]`` contexts."""
        p = self._f64
        ctx = np.asarray(contexts)
        if ctx.ndim != 2 or ctx.shape[1] != self.config.context:
            raise ValueError(f"contexts must have shape [B, {self.config.context}], got {ctx.shape}")
        if ctx.size and (ctx.min() < 0 or ctx.max() >= self.config.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size})")
        x = p["embed"][ctx].reshape(ctx.shape[0], -1)
        h = np.tanh(x @ p["w1"] + p["b1"])
        return h @ p["w2"] + p["b2"]

    forward = logits

    def next_logprobs(self, contexts: np.ndarray) -> np.ndarray:
        """float64 ``[B, V]`` log-probabilities of every next token."""
        return log_softmax(self.logits(contexts))

    def sequence_logprobs(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """float32 array, entry i = log p(ids[i] | ids[:i]) for i >= 1; entry 0 is 0.0 (the
        first token is conditioned on nothing but padding and is never scored)."""
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size == 0:
            return np.zeros(0, dtype=np.float32)
        lp = self.next_logprobs(self.contexts(arr)[:-1])
        out = lp[np.arange(arr.size), arr].astype(np.float32)
        out[0] = 0.0
        return out

    def token_logprobs(self, prompt_ids: Sequence[int] | np.ndarray,
                       response_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """float32 log-probability of each response token given the prompt and the response
        tokens before it (what a trainer recomputes to check the server's numbers)."""
        prompt = np.asarray(prompt_ids, dtype=np.int64)
        resp = np.asarray(response_ids, dtype=np.int64)
        if resp.size == 0:
            return np.zeros(0, dtype=np.float32)
        ctx = self.contexts(np.concatenate([prompt, resp]))[prompt.size:-1]
        lp = self.next_logprobs(ctx)
        return lp[np.arange(resp.size), resp].astype(np.float32)


def default_model() -> ReferenceModel:
    """The weights the policy server uses unless given ``--weights``; a trainer rebuilds the same
    model with this call to recompute log-probabilities."""
    return ReferenceModel.init(seed=0)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))
