"""The one interface every inference backend speaks: token ids in, token ids and log-probs out.

A backend never decodes or re-encodes: the ids it returns are the ids the server sampled, each
with the server's log-probability for it. A response that breaks that promise (ids without
log-probabilities, fewer log-probabilities than ids, an unknown finish reason, more tokens than
``max_tokens``) raises :class:`InferenceProtocolError` in :func:`checked_result`; it is never
shortened or padded to fit.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Sequence

import numpy as np

from rolloutd.native_io.errors import ConfigError, InferenceProtocolError

FINISH_REASONS = frozenset({"stop", "length", "abort"})
MAX_TOP_LOGPROBS = 20
PAUSE_MODES = frozenset({"keep", "abort", "wait"})
HEALTH_STATES = ("ok", "slow", "down")
"""What a health probe found: answered 200; did not answer in time (busy, not gone); refused,
failed or answered an error."""


@dataclass(frozen=True)
class VersionSpan:
    """Generated tokens ``[start, end)`` of one call were sampled under weights ``version``."""

    version: str
    start: int
    end: int


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    """Upper bound on generated tokens; always sent explicitly (old vLLM builds default to 16)."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 (or 0) keeps the whole vocabulary."""
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    """Extra ids that end the turn, besides the model's own end-of-turn tokens."""
    ignore_eos: bool = False
    """Keep generating past the model's end-of-turn tokens (until max_tokens or stop_token_ids)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Further sampling fields passed through to the server as they are (e.g. ``min_p``)."""
    top_logprobs: int = 0
    """How many of the most likely tokens to report at each generated position (0: none; the
    sampled token's own log-probability is always reported). Backends that cannot report them
    leave ``GenerateResult.top_ids`` None."""

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must lie in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ConfigError(f"top_k must be -1 (off), 0 (off) or >= 1, got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ConfigError(f"seed must be an integer or None, got {self.seed!r}")
        ids = tuple(self.stop_token_ids)
        if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
            raise ConfigError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", ids)
        if isinstance(self.top_logprobs, bool) or not isinstance(self.top_logprobs, int) \
                or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ConfigError(f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, "
                              f"got {self.top_logprobs!r}")

    def wire_fields(self, *, max_key: str, seed_key: str) -> dict[str, Any]:
        """The sampling fields as a server's JSON names them (vLLM: ``max_tokens``/``seed``,
        SGLang: ``max_new_tokens``/``sampling_seed``); unset options are left out."""
        fields: dict[str, Any] = {max_key: self.max_tokens, "temperature": self.temperature,
                                  "top_p": self.top_p, "top_k": self.top_k}
        if self.seed is not None:
            fields[seed_key] = self.seed
        if self.stop_token_ids:
            fields["stop_token_ids"] = list(self.stop_token_ids)
        if self.ignore_eos:
            fields["ignore_eos"] = True
        fields.update(self.extra)
        return fields


@dataclass
class GenerateResult:
    token_ids: np.ndarray
    """int32, the generated ids exactly as the server sampled them (a stop token included)."""
    logprobs: np.ndarray
    """float32, the server's log-probability of each generated id (same length as token_ids)."""
    finish_reason: str
    """``stop``, ``length`` or ``abort``."""
    weight_version: str
    """The server's weight version; "" when the protocol does not report one (the pool fills in
    the version it recorded)."""
    server: str
    """Address of the server that produced the tokens."""
    request_id: str = ""
    http_s: float = 0.0
    """Seconds from sending the request to having the whole answer, as the client saw it; the
    rest of a call's time is the client's own overhead."""
    weight_spans: tuple[VersionSpan, ...] = ()
    """The server's own per-token weight versions (vLLM >= 0.32 reports them), covering every
    generated id in order; empty when the protocol reports none. ``weight_version`` is then the
    last span's version (the newest weights that produced a token of this call)."""
    top_ids: np.ndarray | None = None
    """int32 ``[n, k]``: at each generated position the ``k = params.top_logprobs`` most likely
    token ids, most likely first; None when none were asked for or the backend reports none."""
    top_logprobs: np.ndarray | None = None
    """float32 ``[n, k]``: their log-probabilities."""
    sent_version: str = ""
    """The pool's weight version when the call was sent (filled in by the pool)."""
    straddled: bool = False
    """Tokens of more than one weight version may be in it (filled in by the pool)."""


class InferenceBackend(ABC):
    """One inference server (or in-process engine)."""

    address: str
    """Stable name of the server, e.g. ``http://127.0.0.1:8000``."""
    kind: str
    """``vllm-generate``, ``vllm-completions``, ``sglang`` or ``vllm-inprocess``."""
    max_model_len: int | None = None
    """The server's context window (prompt + generated tokens) where it reports one."""

    @abstractmethod
    async def generate(self, prompt_ids: Sequence[int] | np.ndarray, params: SamplingParams, *,
                       request_id: str, timeout_s: float) -> GenerateResult:
        """Generate one turn. Raises InferenceTimeout past ``timeout_s`` (and aborts the request
        on the server), InferenceRejected when the server refuses the request itself,
        InferenceProtocolError for answers that break the protocol, InferenceError when the
        server fails. Cancelling the call aborts the request on the server."""

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Ask the server to stop a request (best effort; the request may already be done)."""

    @abstractmethod
    async def health(self) -> bool:
        """True when the server answers its health probe in time."""

    async def set_weight_version(self, version: str) -> None:
        """Label the server's current weights ``version``, where its protocol has a label that it
        then reports per call (vLLM >= 0.32); a no-op elsewhere."""

    async def probe(self) -> str:
        """One of :data:`HEALTH_STATES`; backends that can tell a slow server from a gone one
        say ``slow`` for the first."""
        return "ok" if await self.health() else "down"

    @abstractmethod
    async def pause(self, mode: str = "keep") -> None:
        """Stop generating. ``keep`` freezes in-flight requests until :meth:`resume`; ``abort``
        ends them with finish reason ``abort``; ``wait`` lets them finish first."""

    @abstractmethod
    async def resume(self) -> None: ...

    @abstractmethod
    async def close(self) -> None: ...


def checked_result(token_ids: Any, logprobs: Any, finish_reason: Any, *, params: SamplingParams,
                   server: str, what: str, weight_version: str = "", request_id: str = "",
                   http_s: float = 0.0, weight_spans: Any = None, top: Any = None) -> GenerateResult:
    """Validate a server's answer and convert it to arrays; ``what`` names the response field
    for the error message (e.g. ``choices[0].token_ids``)."""
    if not isinstance(token_ids, list):
        raise InferenceProtocolError(f"{server} answered without token ids ({what}); "
                                     "is it an inference server speaking this protocol?")
    if not isinstance(logprobs, list):
        raise InferenceProtocolError(
            f"{server} returned {len(token_ids)} token ids without log-probabilities ({what}); "
            "rolloutd needs one log-probability per generated token (logprobs=0 was requested)")
    if len(logprobs) != len(token_ids):
        raise InferenceProtocolError(
            f"{server} returned {len(token_ids)} token ids but {len(logprobs)} log-probabilities "
            f"({what}); refusing a trajectory whose tokens and log-probabilities do not line up")
    # numpy would turn a None into NaN. `in` scans in C: half the cost of a generator, ~20 ns a token.
    if None in logprobs:
        missing = logprobs.index(None)
        raise InferenceProtocolError(f"{server} returned no log-probability for generated token "
                                     f"{missing} of {len(token_ids)} ({what})")
    if finish_reason not in FINISH_REASONS:
        raise InferenceProtocolError(f"{server} gave finish reason {finish_reason!r} ({what}); "
                                     f"expected one of {sorted(FINISH_REASONS)}")
    if len(token_ids) > params.max_tokens:
        raise InferenceProtocolError(f"{server} returned {len(token_ids)} tokens for max_tokens="
                                     f"{params.max_tokens} ({what})")
    try:
        ids = np.array(token_ids, dtype=np.int64)
        lps = np.array(logprobs, dtype=np.float64)
    except (TypeError, ValueError, OverflowError) as e:
        raise InferenceProtocolError(f"{server} returned ids or log-probabilities that are not "
                                     f"numbers ({what}): {e}") from e
    if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max):
        raise InferenceProtocolError(f"{server} returned token ids outside [0, 2^31) ({what})")
    if lps.size and not (np.isfinite(lps).all() and lps.max() <= 1e-6):
        raise InferenceProtocolError(f"{server} returned log-probabilities that are not finite "
                                     f"values <= 0 ({what})")
    spans = checked_spans(weight_spans, len(token_ids), server=server) if weight_spans is not None else ()
    if spans:
        weight_version = spans[-1].version
    top_ids, top_lps = checked_top(top, len(token_ids), params.top_logprobs, server=server, what=what)
    return GenerateResult(token_ids=ids.astype(np.int32), logprobs=lps.astype(np.float32),
                          finish_reason=finish_reason, weight_version=weight_version,
                          server=server, request_id=request_id, http_s=http_s, weight_spans=spans,
                          top_ids=top_ids, top_logprobs=top_lps)


def checked_top(top: Any, n_tokens: int, k: int, *, server: str, what: str
                ) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The ``k`` most likely (id, log-probability) pairs per generated token as arrays
    ``[n, k]``, from a server's per-token lists of pairs (at least ``k`` each, any order); (None,
    None) when ``k`` is 0 or the server reported none (``top`` None)."""
    if not k or top is None:
        return None, None
    if not isinstance(top, list) or len(top) != n_tokens:
        got = len(top) if isinstance(top, list) else "no"
        raise InferenceProtocolError(f"{server} returned top log-probabilities for {got} of {n_tokens} generated "
                                     f"tokens ({what})")
    ids = np.zeros((n_tokens, k), dtype=np.int32)
    lps = np.zeros((n_tokens, k), dtype=np.float32)
    for i, pairs in enumerate(top):
        try:
            ranked = sorted(((float(lp), int(t)) for t, lp in pairs), reverse=True)[:k]
        except (TypeError, ValueError) as e:
            raise InferenceProtocolError(f"{server} returned top log-probabilities that are not (id, value) pairs "
                                         f"at token {i} ({what}): {e}") from e
        if len(ranked) < k:
            raise InferenceProtocolError(f"{server} returned {len(ranked)} top log-probabilities at token {i} for "
                                         f"top_logprobs={k} ({what})")
        ids[i] = [t for _, t in ranked]
        lps[i] = [lp for lp, _ in ranked]
    return ids, lps


def checked_spans(raw: Any, n_tokens: int, *, server: str) -> tuple[VersionSpan, ...]:
    """Per-token weight-version spans as a server reported them (dicts or objects with
    ``version``, ``start``, ``end``), checked to cover ``[0, n_tokens)`` in order without a gap."""
    spans: list[VersionSpan] = []
    try:
        for item in raw:
            get = item.get if isinstance(item, dict) else lambda k, _i=item: getattr(_i, k, None)
            version, start, end = get("version"), get("start"), get("end")
            if not isinstance(version, str) or not isinstance(start, int) or not isinstance(end, int):
                raise TypeError(f"span {item!r} is not (version: str, start: int, end: int)")
            spans.append(VersionSpan(version, start, end))
    except TypeError as e:
        raise InferenceProtocolError(f"{server} reported weight versions that are not spans: {e}") from e
    position = 0
    for span in spans:
        if span.start != position or span.end < span.start:
            raise InferenceProtocolError(f"{server} reported weight-version spans {spans} that do not cover "
                                         f"the {n_tokens} generated tokens in order")
        position = span.end
    if spans and position != n_tokens:
        raise InferenceProtocolError(f"{server} reported weight-version spans up to token {position} for "
                                     f"{n_tokens} generated tokens")
    return tuple(spans)
