"""Sampling one next token for every sequence of a batch from the reference model's logits.

Each sequence draws exactly one uniform number per step from its own generator, so a request
with a seed gives the same tokens whatever else shares its batch. The reported log-probability
is always the raw one, log_softmax(logits)[token], before temperature, top-p or top-k.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from rolloutd.daemon.inference.base import SamplingParams

GREEDY_BELOW = 1e-5
"""Temperatures below this sample greedily (as vLLM does)."""


def sample_batch(logits: np.ndarray, params: Sequence[SamplingParams], rngs: Sequence[np.random.Generator],
                 forced: Sequence[int | None]) -> tuple[np.ndarray, np.ndarray]:
    """Next token and its raw log-probability for each row of ``logits`` (float64 ``[B, V]``).

    ``forced[b]`` is a token the row must emit (scripted replies); its log-probability is still
    the model's true one."""
    b, v = logits.shape
    shifted = logits - logits.max(axis=1, keepdims=True)
    exp = np.exp(shifted)
    total = exp.sum(axis=1)
    tokens = np.empty(b, dtype=np.int64)

    plain: list[int] = []
    for row in range(b):
        p = params[row]
        token = forced[row]
        if token is not None:
            tokens[row] = token
        elif p.temperature < GREEDY_BELOW:
            tokens[row] = int(np.argmax(shifted[row]))
        elif p.temperature == 1.0 and p.top_p >= 1.0 and p.top_k <= 0:
            plain.append(row)
        else:
            tokens[row] = _sample_filtered(shifted[row], p, rngs[row].random())
    if plain:
        # Rows with the model's own distribution share one vectorised inverse-CDF draw.
        idx = np.asarray(plain)
        u = np.fromiter((rngs[r].random() for r in plain), dtype=np.float64, count=len(plain))
        cdf = np.cumsum(exp[idx], axis=1)
        picked = (cdf <= (u * cdf[:, -1])[:, None]).sum(axis=1)
        tokens[idx] = np.minimum(picked, v - 1)
    logprobs = shifted[np.arange(b), tokens] - np.log(total)
    return tokens, logprobs


def top_logprobs(logits: np.ndarray, ks: Sequence[int]) -> list[list[tuple[int, float]]]:
    """Per row, the ``ks[row]`` most likely (token, raw log-probability), most likely first (ties
    to the lower id); empty rows where ``ks[row]`` is 0."""
    out: list[list[tuple[int, float]]] = [[] for _ in ks]
    for row, k in enumerate(ks):
        if k:
            lp = logits[row] - logits[row].max()
            lp = lp - np.log(np.exp(lp).sum())
            best = np.argsort(-lp, kind="stable")[:k]
            out[row] = [(int(t), float(np.float32(lp[t]))) for t in best]
    return out


def _sample_filtered(shifted: np.ndarray, p: SamplingParams, u: float) -> int:
    scaled = shifted / p.temperature
    weights = np.exp(scaled - scaled.max())
    if 0 < p.top_k < weights.size:
        cut = np.partition(weights, -p.top_k)[-p.top_k]
        weights = np.where(weights >= cut, weights, 0.0)
    if p.top_p < 1.0:
        order = np.argsort(-weights, kind="stable")
        sorted_w = weights[order]
        cum = np.cumsum(sorted_w)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        keep = int(np.searchsorted(cum, p.top_p * cum[-1])) + 1
        mask = np.zeros_like(weights)
        mask[order[:keep]] = 1.0
        weights = weights * mask
    cdf = np.cumsum(weights)
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), weights.size - 1))
