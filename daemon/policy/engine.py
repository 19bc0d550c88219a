"""The reference policy's generation engine: continuous batching over the numpy model.

One stepper task advances every running sequence by one token per step with a single batched
forward pass, like a GPU server's decode loop. Requests join and leave the batch between steps.

Slot simulation (``slots``/``ms_per_token``) stands in for a GPU server in utilisation
benchmarks: at most ``slots`` sequences decode at once (the rest queue) and a step takes at
least ``ms_per_token`` ms of (async) time. The engine integrates ``running/slots`` over time,
which is what :meth:`utilisation` reports.

Pause modes follow vLLM: ``keep`` freezes running sequences until :meth:`resume`, ``abort`` ends
every request it holds (finish reason ``abort``, tokens so far returned), ``wait`` lets running
ones finish first. While paused no step runs and new requests queue.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from rolloutd.daemon.inference.base import PAUSE_MODES, SamplingParams
from rolloutd.daemon.policy.model import ReferenceModel
from rolloutd.daemon.policy.sampling import sample_batch, top_logprobs
from rolloutd.native_io.errors import BadRequest, OperationTimeout

logger = logging.getLogger(__name__)

THREAD_BATCH = 32
"""Batches at least this large run their numpy step in a thread so the HTTP side keeps going."""


@dataclass
class EngineRequest:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str = ""
    forced: list[int] | None = None
    """Tokens to emit instead of sampling (scripted replies)."""


@dataclass
class EngineOutput:
    request_id: str
    token_ids: list[int]
    logprobs: list[float]
    """float32 values (as Python floats)."""
    top: list[list[tuple[int, float]]] | None
    """Per generated token, the ``params.top_logprobs`` most likely (id, log-probability), most
    likely first; None when none were asked for."""
    finish_reason: str
    weight_version: str
    prompt_tokens: int
    e2e_s: float
    weight_spans: list[tuple[str, int, int]] = field(default_factory=list)
    """``(version, start, end)`` runs of generated tokens under one weight version, as vLLM 0.32
    reports them: a call that spans a weight update (pause keep, load, resume) has several."""


@dataclass(eq=False)
class _Sequence:
    req: EngineRequest
    context: list[int]
    stops: frozenset[int]
    rng: np.random.Generator
    future: asyncio.Future[EngineOutput]
    started: float
    out_ids: list[int] = field(default_factory=list)
    out_lps: list[float] = field(default_factory=list)
    out_top: list[list[tuple[int, float]]] = field(default_factory=list)
    out_versions: list[str] = field(default_factory=list)


class PolicyEngine:
    def __init__(self, model: ReferenceModel, *, stop_ids: frozenset[int], slots: int | None = None,
                 ms_per_token: float = 0.0, weight_version: str = "0", seed: int = 0,
                 max_batch: int = 1024) -> None:
        if slots is not None and slots < 1:
            raise BadRequest(f"slots must be >= 1, got {slots}")
        self.model = model
        self.weight_version = weight_version
        self._stop_ids = stop_ids
        self._slots = slots
        self._max_batch = slots or max_batch
        self._step_s = ms_per_token / 1000.0
        self._seed_rng = np.random.default_rng(seed)
        self._waiting: list[_Sequence] = []
        self._running: list[_Sequence] = []
        self._by_id: dict[str, _Sequence] = {}
        self._wake = asyncio.Event()
        self._paused = False
        self._draining = False
        self._drained = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._busy_s = 0.0
        self._window_start = time.monotonic()
        self.steps = 0

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="policy-engine")

    async def stop(self) -> None:
        self.abort(None)
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    # --- requests ----------------------------------------------------------------------------

    async def generate(self, req: EngineRequest) -> EngineOutput:
        if not req.prompt_ids:
            raise BadRequest("the prompt must hold at least one token id")
        vocab = self.model.config.vocab_size
        if min(req.prompt_ids) < 0 or max(req.prompt_ids) >= vocab:
            raise BadRequest(f"prompt token ids must lie in [0, {vocab})")
        if any(t >= vocab for t in req.params.stop_token_ids):
            raise BadRequest(f"stop_token_ids must lie in [0, {vocab})")
        req.request_id = req.request_id or uuid.uuid4().hex
        if req.request_id in self._by_id:
            raise BadRequest(f"request id {req.request_id!r} is already running; use a fresh id")
        seed = req.params.seed
        rng = np.random.default_rng(seed if seed is not None else self._seed_rng.integers(2**63))
        c = self.model.config.context
        context = ([self.model.config.pad_id] * c + req.prompt_ids)[-c:]
        stops = frozenset(req.params.stop_token_ids) | (frozenset() if req.params.ignore_eos else self._stop_ids)
        seq = _Sequence(req=req, context=context, stops=stops,
                        rng=rng, future=asyncio.get_running_loop().create_future(), started=time.monotonic())
        self._by_id[req.request_id] = seq
        self._waiting.append(seq)
        self._wake.set()
        try:
            return await seq.future
        except asyncio.CancelledError:
            # The client went away: free the slot as vLLM does on disconnect.
            self._finish(seq, "abort")
            raise

    def abort(self, request_ids: list[str] | None) -> int:
        """End the named requests (all when None) with finish reason ``abort``."""
        seqs = list(self._by_id.values()) if request_ids is None else [
            self._by_id[r] for r in request_ids if r in self._by_id]
        for seq in seqs:
            self._finish(seq, "abort")
        return len(seqs)

    # --- control -----------------------------------------------------------------------------

    @property
    def is_paused(self) -> bool:
        return self._paused

    @property
    def running(self) -> int:
        return sum(1 for s in self._running if not s.future.done())

    @property
    def waiting(self) -> int:
        return sum(1 for s in self._waiting if not s.future.done())

    async def pause(self, mode: str = "keep", *, wait_timeout_s: float = 600.0) -> None:
        if mode not in PAUSE_MODES:
            raise BadRequest(f"pause mode must be one of {sorted(PAUSE_MODES)}, got {mode!r}")
        if mode == "wait":
            self._draining = True
            self._drained.clear()
            self._wake.set()
            try:
                async with asyncio.timeout(wait_timeout_s):
                    await self._drained.wait()
            except TimeoutError as e:
                raise OperationTimeout(f"running requests did not finish within {wait_timeout_s}s "
                                       "of pause(mode='wait'); use mode 'keep' or 'abort'") from e
            finally:
                self._draining = False
        self._paused = True
        if mode == "abort":
            self.abort(None)
        logger.info("paused (mode %s): %d running, %d waiting", mode, self.running, self.waiting)

    def resume(self) -> None:
        self._paused = False
        self._wake.set()
        logger.info("resumed: %d running, %d waiting", self.running, self.waiting)

    def load_model(self, model: ReferenceModel, weight_version: str | None = None) -> None:
        if model.config.vocab_size != self.model.config.vocab_size:
            raise BadRequest(f"new weights have vocab {model.config.vocab_size}, the tokenizer "
                             f"has {self.model.config.vocab_size}")
        self.model = model
        if weight_version is not None:
            self.weight_version = weight_version

    def utilisation(self) -> tuple[float, float]:
        """(time-average of running/slots since the last reset, seconds since that reset)."""
        window = time.monotonic() - self._window_start
        return (self._busy_s / window if window > 0 else 0.0), window

    def reset_utilisation(self) -> None:
        self._busy_s = 0.0
        self._window_start = time.monotonic()

    # --- the decode loop ---------------------------------------------------------------------

    def _finish(self, seq: _Sequence, reason: str) -> None:
        self._by_id.pop(seq.req.request_id, None)
        if seq.future.done():
            return
        seq.future.set_result(EngineOutput(
            request_id=seq.req.request_id, token_ids=list(seq.out_ids), logprobs=list(seq.out_lps),
            top=list(seq.out_top) if seq.req.params.top_logprobs else None, finish_reason=reason,
            weight_version=self.weight_version, prompt_tokens=len(seq.req.prompt_ids),
            e2e_s=time.monotonic() - seq.started, weight_spans=_spans(seq.out_versions)))

    def _admit(self) -> None:
        self._running = [s for s in self._running if not s.future.done()]
        self._waiting = [s for s in self._waiting if not s.future.done()]
        if self._draining:
            if not self._running:
                self._drained.set()
            return
        free = self._max_batch - len(self._running)
        if free > 0 and self._waiting:
            self._running.extend(self._waiting[:free])
            del self._waiting[:free]

    async def _run(self) -> None:
        while True:
            if not self._paused:
                self._admit()
            if self._paused or not self._running:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = list(self._running)
            started = time.monotonic()
            if len(batch) >= THREAD_BATCH:
                tokens, logprobs, top = await asyncio.to_thread(self._compute, batch)
            else:
                tokens, logprobs, top = self._compute(batch)
            self._apply(batch, tokens, logprobs, top)
            self.steps += 1
            wait = self._step_s - (time.monotonic() - started)
            await asyncio.sleep(max(wait, 0.0))
            occupied = min(len(batch), self._slots) / self._slots if self._slots else 1.0
            self._busy_s += occupied * (time.monotonic() - started)

    def _compute(self, batch: list[_Sequence]) -> tuple[np.ndarray, np.ndarray, list[list[tuple[int, float]]]]:
        logits = self.model.logits(np.array([s.context for s in batch], dtype=np.int64))
        forced = [s.req.forced[len(s.out_ids)] if s.req.forced is not None else None for s in batch]
        tokens, logprobs = sample_batch(logits, [s.req.params for s in batch], [s.rng for s in batch], forced)
        return tokens, logprobs.astype(np.float32), top_logprobs(logits, [s.req.params.top_logprobs for s in batch])

    def _apply(self, batch: list[_Sequence], tokens: np.ndarray, logprobs: np.ndarray,
               top: list[list[tuple[int, float]]]) -> None:
        for seq, tok, lp, best in zip(batch, tokens.tolist(), logprobs.tolist(), top):
            if seq.future.done():  # aborted while the step ran
                continue
            seq.out_ids.append(tok)
            seq.out_lps.append(lp)
            seq.out_top.append(best)
            seq.out_versions.append(self.weight_version)
            seq.context = seq.context[1:] + [tok]
            if tok in seq.stops:
                self._finish(seq, "stop")
            elif len(seq.out_ids) >= seq.req.params.max_tokens or (
                    seq.req.forced is not None and len(seq.out_ids) >= len(seq.req.forced)):
                self._finish(seq, "length")


def _spans(versions: list[str]) -> list[tuple[str, int, int]]:
    """Runs of equal versions as ``(version, start, end)``."""
    spans: list[tuple[str, int, int]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1][0] == v:
            spans[-1] = (v, spans[-1][1], i + 1)
        else:
            spans.append((v, i, i + 1))
    return spans
