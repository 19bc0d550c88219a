"""vLLM in the same process (optional extra ``rolloutd[vllm]``; vllm is imported only when used).

Written against vLLM's documented engine API (shared/notes/inference_protocols.md, section 1d)::

    AsyncLLM.generate(TokensPrompt(prompt_token_ids=ids),
                      SamplingParams(logprobs=0, detokenize=False, output_kind=FINAL_ONLY, ...),
                      request_id=...)

The last RequestOutput's ``outputs[0]`` holds ``token_ids``, ``logprobs`` (one ``{token_id:
Logprob}`` mapping per generated token; with ``logprobs=0`` the sampled token is always in it)
and ``finish_reason``, and (vLLM >= 0.32) ``weight_versions``, the per-token version spans.
:func:`result_from_request_output` does that conversion. On a node the engine lives in one
process shared by the workers (:mod:`rolloutd.daemon.inference.engine_host`), not in each worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace
from typing import Any
from collections.abc import Sequence

import numpy as np

from rolloutd.daemon.inference.base import (
    PAUSE_MODES,
    GenerateResult,
    InferenceBackend,
    SamplingParams,
    checked_result,
)
from rolloutd.native_io.errors import (
    ConfigError,
    InferenceError,
    InferenceProtocolError,
    InferenceTimeout,
    MissingDependency,
)

logger = logging.getLogger(__name__)

_WHAT = "RequestOutput.outputs[0].token_ids / .logprobs"


def import_vllm() -> SimpleNamespace:
    """The vLLM names this backend uses; MissingDependency saying how to install vLLM if missing."""
    try:
        from vllm import AsyncEngineArgs, TokensPrompt
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError as e:
        raise MissingDependency("the vllm-inprocess backend needs vLLM in this environment: "
                          "pip install 'rolloutd[vllm]' (or use a vLLM server: vllm+http://HOST:PORT)") from e
    return SimpleNamespace(AsyncEngineArgs=AsyncEngineArgs, TokensPrompt=TokensPrompt,
                           SamplingParams=VLLMSamplingParams, RequestOutputKind=RequestOutputKind,
                           AsyncLLM=AsyncLLM)


def _sampled_logprob(position: Any, token: int) -> float | None:
    if position is None:
        return None
    entry = position.get(token) if hasattr(position, "get") else None
    if entry is None:
        return None
    return float(getattr(entry, "logprob", entry))


def result_from_request_output(out: Any, *, params: SamplingParams, server: str, request_id: str,
                               http_s: float = 0.0) -> GenerateResult:
    """Convert a vLLM ``RequestOutput`` (or anything shaped like one) into a checked result."""
    outputs = getattr(out, "outputs", None)
    if not outputs:
        raise InferenceProtocolError(f"{server}: the RequestOutput of {request_id} has no outputs")
    first = outputs[0]
    ids = [int(t) for t in first.token_ids]
    positions = first.logprobs
    logprobs: list[float | None] | None
    if positions is None or len(positions) != len(ids):
        # checked_result reports the missing or misaligned log-probabilities.
        logprobs = None if positions is None else [None] * len(positions)
    else:
        logprobs = [_sampled_logprob(p, t) for p, t in zip(positions, ids)]
    return checked_result(ids, logprobs, first.finish_reason, params=params, server=server, what=_WHAT,
                          request_id=request_id, http_s=http_s,
                          weight_spans=getattr(first, "weight_versions", None))


class VLLMInProcessBackend(InferenceBackend):
    kind = "vllm-inprocess"

    def __init__(self, engine: Any, *, address: str) -> None:
        """``engine`` is a running ``vllm.v1.engine.async_llm.AsyncLLM``."""
        self._vllm = import_vllm()
        self._engine = engine
        self.address = address
        limit = getattr(getattr(engine, "model_config", None), "max_model_len", None)
        self.max_model_len = limit if isinstance(limit, int) else None

    @classmethod
    def from_model(cls, model: str, **engine_args: Any) -> VLLMInProcessBackend:
        """An engine for ``model`` with rolloutd's weight-reload worker extension."""
        vllm = import_vllm()
        engine_args.setdefault("worker_extension_cls", "rolloutd.daemon.inference.vllm_worker_ext.WeightReload")
        engine = vllm.AsyncLLM.from_engine_args(vllm.AsyncEngineArgs(model=model, **engine_args))
        return cls(engine, address=f"vllm-inprocess:{model}")

    async def set_weight_version(self, version: str) -> None:
        await self._engine.update_weight_version(version)

    async def update_weights(self, *, path: str | None = None, blob: bytes | None = None,
                             version: str | None = None) -> None:
        """Load new weights (an HF folder or one safetensors blob), drop the prefix cache computed
        under the old ones, and label them ``version`` (reported per token from then on)."""
        if (path is None) == (blob is None):
            raise ConfigError("update_weights needs exactly one of path (a folder) or blob (safetensors bytes)")
        if path is not None:
            await self._engine.collective_rpc("reload_from_path", kwargs={"weights_path": path})
        else:
            await self._engine.collective_rpc("reload_from_bytes", args=(blob,))
        await self._engine.reset_prefix_cache()
        if version is not None:
            await self._engine.update_weight_version(version)

    def _sampling(self, params: SamplingParams) -> Any:
        return self._vllm.SamplingParams(
            max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
            top_k=params.top_k, seed=params.seed, stop_token_ids=list(params.stop_token_ids),
            ignore_eos=params.ignore_eos,
            logprobs=0, detokenize=False, output_kind=self._vllm.RequestOutputKind.FINAL_ONLY,
            **params.extra)

    async def generate(self, prompt_ids: Sequence[int] | np.ndarray, params: SamplingParams, *,
                       request_id: str, timeout_s: float) -> GenerateResult:
        prompt = self._vllm.TokensPrompt(prompt_token_ids=[int(t) for t in prompt_ids])
        final = None
        started = time.perf_counter()
        try:
            async with asyncio.timeout(timeout_s):
                # Cancelling the generator (our cancel or the deadline) makes vLLM abort the request.
                async for out in self._engine.generate(prompt, self._sampling(params), request_id=request_id):
                    final = out
        except TimeoutError as e:
            raise InferenceTimeout(f"{self.address} did not finish request {request_id} within "
                                   f"{timeout_s:.1f}s; it was aborted. Raise the turn deadline (timeout_s).") from e
        if final is None:
            raise InferenceError(f"{self.address} produced no output for request {request_id}")
        return result_from_request_output(final, params=params, server=self.address, request_id=request_id,
                                          http_s=time.perf_counter() - started)

    async def abort(self, request_id: str) -> None:
        await self._engine.abort(request_id)

    async def health(self) -> bool:
        try:
            await self._engine.check_health()
        except Exception as e:  # noqa: BLE001 - any failure of the probe means unhealthy
            logger.warning("%s failed its health check: %s", self.address, e)
            return False
        return True

    async def pause(self, mode: str = "keep") -> None:
        if mode not in PAUSE_MODES:
            raise ConfigError(f"pause mode must be one of {sorted(PAUSE_MODES)}, got {mode!r}")
        await self._engine.pause_generation(mode=mode)

    async def resume(self) -> None:
        await self._engine.resume_generation()

    async def close(self) -> None:
        self._engine.shutdown()
