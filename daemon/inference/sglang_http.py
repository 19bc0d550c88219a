"""SGLang over HTTP, token ids in and out (shared/notes/inference_protocols.md, section 2).

``POST /generate`` with ``input_ids``, ``sampling_params`` (``max_new_tokens``) and
``return_logprob: true``; ids and log-probabilities both come from
``meta_info.output_token_logprobs`` (``[logprob, token_id, text|null]`` triples), the finish reason
from ``meta_info.finish_reason.type`` and the weight version from ``meta_info.weight_version``.
Pause maps rolloutd's ``keep`` onto SGLang's ``in_place`` (requests keep their state and continue
after ``/continue_generation``) and ``abort`` onto ``abort``; SGLang has no ``wait`` mode.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Sequence

import numpy as np

from rolloutd.daemon.inference.base import GenerateResult, SamplingParams, checked_result
from rolloutd.daemon.inference.http_backend import HTTPBackend, prompt_list
from rolloutd.native_io.errors import ConfigError, InferenceProtocolError

GENERATE_PATH = "/generate"
_PAUSE_MODES = {"keep": "in_place", "abort": "abort"}
_WHAT = "meta_info.output_token_logprobs"


def generate_request(prompt: list[int], params: SamplingParams, request_id: str) -> dict[str, Any]:
    sampling = {**params.wire_fields(max_key="max_new_tokens", seed_key="sampling_seed"), "skip_special_tokens": False}
    return {"rid": request_id, "input_ids": prompt, "sampling_params": sampling, "return_logprob": True,
            "stream": False}


def parse_generate_response(obj: dict[str, Any], server: str) -> tuple[Any, Any, Any, str]:
    """(ids, logprobs, finish_reason, weight_version) from a ``/generate`` answer, unchecked."""
    meta = obj.get("meta_info")
    if not isinstance(meta, dict):
        raise InferenceProtocolError(f"{server}: the answer has no meta_info object")
    triples = meta.get("output_token_logprobs")
    if not isinstance(triples, list):
        output_ids = obj.get("output_ids")
        return output_ids if isinstance(output_ids, list) else None, None, None, ""
    if not all(isinstance(t, (list, tuple)) and len(t) >= 2 for t in triples):
        raise InferenceProtocolError(f"{server}: {_WHAT} must hold [logprob, token_id, text] triples")
    ids = [t[1] for t in triples]
    logprobs = [t[0] for t in triples]
    output_ids = obj.get("output_ids")
    if isinstance(output_ids, list) and output_ids != ids:
        raise InferenceProtocolError(f"{server}: output_ids ({len(output_ids)} ids) differ from the ids in "
                                     f"{_WHAT} ({len(ids)}); refusing an answer that disagrees with itself")
    finish = meta.get("finish_reason")
    reason = finish.get("type") if isinstance(finish, dict) else finish
    version = meta.get("weight_version")
    return ids, logprobs, reason, "" if version is None else str(version)


class SGLangHTTPBackend(HTTPBackend):
    kind = "sglang"

    async def generate(self, prompt_ids: Sequence[int] | np.ndarray, params: SamplingParams, *,
                       request_id: str, timeout_s: float) -> GenerateResult:
        payload = generate_request(prompt_list(prompt_ids), params, request_id)
        obj, http_s = await self._generate_json(GENERATE_PATH, payload, timeout_s=timeout_s, request_id=request_id,
                                                prompt_key="input_ids")
        ids, logprobs, finish, version = parse_generate_response(obj, self.address)
        return checked_result(ids, logprobs, finish, params=params, server=self.address, what=_WHAT,
                              weight_version=version, request_id=request_id, http_s=http_s)

    async def abort(self, request_id: str) -> None:
        await self._control("POST", "/abort_request", {"rid": request_id})

    async def pause(self, mode: str = "keep") -> None:
        if mode not in _PAUSE_MODES:
            raise ConfigError(f"SGLang pause modes are {sorted(_PAUSE_MODES)} (no 'wait'), got {mode!r}")
        await self._control("POST", "/pause_generation", {"mode": _PAUSE_MODES[mode]})

    async def resume(self) -> None:
        await self._control("POST", "/continue_generation", {})

    def _missing_route_hint(self, path: str) -> str:
        if path in ("/pause_generation", "/continue_generation"):
            return "this SGLang predates pause/continue generation; upgrade it"
        return "is this an SGLang server?"
