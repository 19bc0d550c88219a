"""One rollout's proxy state: turns a chat request into a model turn on the running token list.

Requests are served one at a time (a harness's parallel requests wait for each other): the token
history is one object and the inference pool keeps a trajectory on one server. A request that
cannot be served ends the trajectory when no later request could be served either — the model
turn limit, the context limit, the deadline, an aborted turn — and every later request is
refused with ``rolloutd_trajectory_ended``, so a harness stops instead of retrying; the agent
watches :attr:`ProxySession.ended` to stop a harness that keeps going. Errors a retry may fix
(an inference server failing) leave the history as it was, so the same request can come again.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from rolloutd.daemon.agents.base import AgentOutcome
from rolloutd.daemon.inference.base import GenerateResult
from rolloutd.native_io.errors import BadRequest, ConfigError, OperationTimeout, SpecialTokenInContent

from .history import History
from .admission import check_size
from .protocol import UNAPPLIED_MODES, ChatRequest, Completion, TokenLogprob
from .reply import token_bytes

log = logging.getLogger(__name__)

Generate = Callable[[list[int], int, int], Awaitable[GenerateResult]]
"""(prompt ids, max tokens, top log-probabilities per position) -> one model turn; the agent
context's ``generate``."""

ENDED = "rolloutd_trajectory_ended"
T = TypeVar("T")


@dataclass(frozen=True)
class ProxyLimits:
    max_requests: int = 100
    """Model turns at most (all segments together); the next request ends the trajectory
    with finish reason ``max_turns``."""
    max_context_tokens: int = 32768
    """Bound on one segment's tokens (prompt + response); reaching it ends with ``max_tokens``."""
    max_tokens_per_turn: int = 4096
    """Tokens one turn may generate; a request's ``max_completion_tokens`` may lower it."""

    def __post_init__(self) -> None:
        for name in ("max_requests", "max_context_tokens", "max_tokens_per_turn"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")


async def _off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a worker thread. A cancelled caller (the harness hung up) still waits for
    the thread, so the history is never touched by two requests at once (the caller holds the
    session's lock)."""
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        await asyncio.wait([work])
        if not work.cancelled():
            work.exception()  # nobody is left to be told
        raise


class ProxySession:
    def __init__(self, generate: Generate, tokenizer: Any, *, model: str, limits: ProxyLimits,
                 template_check: str = "final", unapplied_fields: str = "refuse",
                 content_special_tokens: str = "text") -> None:
        if unapplied_fields not in UNAPPLIED_MODES:
            raise ConfigError(f"unapplied_fields must be one of {UNAPPLIED_MODES}, got {unapplied_fields!r}")
        self.unapplied_fields = unapplied_fields
        """Request fields the proxy cannot apply (sampling fields): ``refuse`` (400 naming the
        field) or ``report`` (accepted, listed in ``metrics["ignored_request_fields"]``)."""
        self._generate = generate
        self.model = model
        self.limits = limits
        self.history = History(tokenizer, limits.max_context_tokens, template_check, content_special_tokens)
        self._lock = asyncio.Lock()
        self.stop_reason: str | None = None
        """The agent finish reason that ended the trajectory from the proxy's side, if any."""
        self.ended = asyncio.Event()
        self.turns = 0
        self.refused = 0
        self.generate_s = 0.0
        self.ignored_fields: set[str] = set()
        self.tool_calls: Counter[str] = Counter()
        self.streamed = 0

    def end(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
            log.info("openai proxy: trajectory ended (%s)", reason)
        self.ended.set()

    async def complete(self, request: ChatRequest) -> Completion:
        """One model turn for ``request``. Raises BadRequest (refused; ``details["code"]`` says
        why), InferenceError (a retry may succeed)."""
        async with self._lock:
            try:
                return await self._complete(request)
            except BadRequest:
                self.refused += 1
                raise

    async def _complete(self, request: ChatRequest) -> Completion:
        if self.stop_reason is not None:
            raise BadRequest(f"this trajectory has ended ({self.stop_reason}); no more model turns are served",
                             details={"code": ENDED})
        self.ignored_fields.update(request.ignored)
        if self.turns >= self.limits.max_requests:
            self.end("max_turns")
            raise BadRequest(f"the trajectory used its {self.limits.max_requests} model turns (max_requests)",
                             details={"code": ENDED})
        try:
            await check_size(request, self.history.tokenizer, self.limits.max_context_tokens)
            # Rendering and encoding hold the loop for as long as the messages are long.
            segment = await _off_loop(self.history.prepare, request)
        except BadRequest as e:
            if e.details.get("code") == "context_length_exceeded":
                self.end("max_tokens")
            raise
        except SpecialTokenInContent as e:
            self.end("special_token")
            raise BadRequest(f"{e}; the trajectory ends here", details={"code": ENDED, "param": "messages"}) from e
        ledger = segment.ledger
        room = ledger.room
        if room < 1:
            self.end("max_tokens")
            raise BadRequest(f"no room is left under max_context_tokens={self.limits.max_context_tokens}",
                             details={"code": "context_length_exceeded", "param": "messages"})
        max_tokens = min(self.limits.max_tokens_per_turn, room, request.max_tokens or room)
        t0 = time.monotonic()
        try:
            result = await self._generate(ledger.ids, max_tokens, request.top_logprobs)
        except OperationTimeout as e:
            self.end("timeout")
            raise BadRequest(f"the trajectory reached its deadline: {e}", details={"code": ENDED}) from e
        finally:
            self.generate_s += time.monotonic() - t0
        self.turns += 1
        if request.top_logprobs and result.top_ids is None:
            raise BadRequest(f"top_logprobs={request.top_logprobs} cannot be honoured: the inference server "
                             f"{result.server} does not report top log-probabilities (the turn is not recorded)",
                             details={"param": "top_logprobs", "code": "unsupported_parameter"})
        turn = self.history.record(segment, result, request)
        if result.finish_reason == "abort":
            self.end("cancelled")
            raise BadRequest("the inference server aborted this turn (a weight update cancelled the trajectory)",
                             details={"code": ENDED})
        if result.finish_reason == "length" and len(result.token_ids) >= room:
            self.end("max_tokens")  # this reply still goes out; the next request is refused
        self.tool_calls.update(c.name for c in turn.message.tool_calls)
        self.streamed += int(request.stream)
        recorded = turn.result
        logprobs = None
        if request.logprobs:
            logprobs = self._logprobs(recorded, turn.reply_ids, ledger.codec.decode)
        return Completion(id="chatcmpl-" + secrets.token_hex(12), model=request.model, message=turn.message,
                          finish_reason=turn.finish_reason, prompt_tokens=turn.prompt_tokens,
                          completion_tokens=len(recorded.token_ids), logprobs=logprobs,
                          fingerprint=f"rolloutd-{recorded.weight_version}", stop_sequence=turn.stop_sequence)

    def _logprobs(self, result: GenerateResult, n: int, decode: Callable[[list[int]], str]) -> list[TokenLogprob]:
        """The first ``n`` tokens of a turn as the API lists them, with their top alternatives."""
        special = self.history.special_ids

        def entry(token: int, logprob: float) -> tuple[str, float, bytes]:
            return decode([token]), logprob, token_bytes(self.history.tokenizer, token, special, decode)

        out = []
        for i, (token, logprob) in enumerate(zip(result.token_ids[:n].tolist(), result.logprobs.tolist())):
            top = [] if result.top_ids is None or result.top_logprobs is None else [
                entry(t, lp) for t, lp in zip(result.top_ids[i].tolist(), result.top_logprobs[i].tolist())]
            out.append(TokenLogprob(*entry(token, logprob), top))
        return out

    def outcome(self, finish_reason: str, *, keep: str = "all", metrics: dict[str, Any] | None = None) -> AgentOutcome:
        """The trajectory; call once no request is in flight (the server is closed)."""
        return self.history.outcome(finish_reason=finish_reason, keep=keep, metrics={
            **(metrics or {}), "generate_s": self.generate_s, "refused_requests": self.refused,
            "streamed_requests": self.streamed, "ignored_request_fields": sorted(self.ignored_fields),
            "tool_calls": dict(self.tool_calls)})
