"""vLLM over HTTP, token ids in and out (shared/notes/inference_protocols.md, section 1).

Two routes, chosen per server (:mod:`rolloutd.daemon.inference.factory` detects which one it has):
- ``generate``: ``POST /inference/v1/generate`` with ``token_ids`` and ``sampling_params``
  (explicit ``max_tokens``, ``logprobs: 0``, ``detokenize: false``); ids from
  ``choices[0].token_ids``, log-probabilities from ``choices[0].logprobs.content[*].logprob``.
- ``completions``: ``POST /v1/completions`` with ``prompt`` as a list of ints, ``return_token_ids``,
  ``logprobs: 0``, ``skip_special_tokens: false``, ``include_stop_str_in_output: true``; ids from
  ``choices[0].token_ids``, log-probabilities from ``choices[0].logprobs.token_logprobs``.

vLLM reports no weight version in either answer: the pool records the version it was told.
Pause and resume use the RL control routes (``/pause?mode=``, ``/resume``, ``/abort_requests``),
which vLLM serves only with ``VLLM_SERVER_DEV_MODE=1``. A cancelled or timed-out call closes its
connection, which makes vLLM drop the request; ``/abort_requests`` is sent as well, best effort
(vLLM may track the request under a prefixed internal id).
"""

from __future__ import annotations

from typing import Any
from collections.abc import Sequence

import numpy as np

from rolloutd.daemon.inference.base import PAUSE_MODES, GenerateResult, SamplingParams, checked_result
from rolloutd.daemon.inference.http_backend import HTTPBackend, prompt_list
from rolloutd.native_io.errors import ConfigError, InferenceProtocolError

GENERATE_PATH = "/inference/v1/generate"
COMPLETIONS_PATH = "/v1/completions"
ROUTES = {"generate": GENERATE_PATH, "completions": COMPLETIONS_PATH}


def _sampling_fields(params: SamplingParams) -> dict[str, Any]:
    # logprobs=0: only the sampled token's log-probability (vLLM always includes it).
    return {**params.wire_fields(max_key="max_tokens", seed_key="seed"), "logprobs": 0}


def generate_request(prompt: list[int], params: SamplingParams, request_id: str,
                     model: str | None = None) -> dict[str, Any]:
    sampling = _sampling_fields(params)
    sampling["detokenize"] = False
    body: dict[str, Any] = {"request_id": request_id, "token_ids": prompt, "sampling_params": sampling,
                            "stream": False}
    if model:
        body["model"] = model
    return body


def completions_request(prompt: list[int], params: SamplingParams, request_id: str,
                        model: str | None = None) -> dict[str, Any]:
    body = _sampling_fields(params)
    body.update({"prompt": prompt, "return_token_ids": True, "skip_special_tokens": False,
                 "include_stop_str_in_output": True, "request_id": request_id, "stream": False})
    if model:
        body["model"] = model
    return body


def _first_choice(obj: dict[str, Any], server: str) -> dict[str, Any]:
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise InferenceProtocolError(f"{server}: the answer has no choices[0] object")
    return choices[0]


def parse_generate_response(obj: dict[str, Any], server: str) -> tuple[Any, Any, Any]:
    """(ids, logprobs, finish_reason) from a ``/inference/v1/generate`` answer, unchecked."""
    choice = _first_choice(obj, server)
    ids = choice.get("token_ids")
    lp = choice.get("logprobs")
    content = lp.get("content") if isinstance(lp, dict) else None
    if not isinstance(content, list):
        return ids, None, choice.get("finish_reason")
    logprobs = [entry.get("logprob") if isinstance(entry, dict) else None for entry in content]
    if isinstance(ids, list) and len(ids) == len(content):
        for k, (entry, tok) in enumerate(zip(content, ids)):
            name = entry.get("token") if isinstance(entry, dict) else None
            # vLLM names each logprob's token "token_id:N" when it does not detokenize.
            if isinstance(name, str) and name.startswith("token_id:") and name != f"token_id:{tok}":
                raise InferenceProtocolError(f"{server}: log-probability {k} is for {name} but token_ids[{k}] "
                                             f"is {tok}; the answer's ids and log-probabilities disagree")
    return ids, logprobs, choice.get("finish_reason")


def parse_completions_response(obj: dict[str, Any], server: str) -> tuple[Any, Any, Any]:
    """(ids, logprobs, finish_reason) from a ``/v1/completions`` answer, unchecked."""
    choice = _first_choice(obj, server)
    lp = choice.get("logprobs")
    logprobs = lp.get("token_logprobs") if isinstance(lp, dict) else None
    return choice.get("token_ids"), logprobs, choice.get("finish_reason")


class VLLMHTTPBackend(HTTPBackend):
    def __init__(self, base_url: str, *, route: str = "generate", model: str | None = None,
                 **http_options: Any) -> None:
        if route not in ROUTES:
            raise ConfigError(f"vLLM route must be one of {sorted(ROUTES)}, got {route!r}")
        super().__init__(base_url, **http_options)
        self.kind = f"vllm-{route}"
        self.route = route
        self._path = ROUTES[route]
        self._model = model

    async def generate(self, prompt_ids: Sequence[int] | np.ndarray, params: SamplingParams, *,
                       request_id: str, timeout_s: float) -> GenerateResult:
        prompt = prompt_list(prompt_ids)
        if self.route == "generate":
            payload = generate_request(prompt, params, request_id, self._model)
        else:
            payload = completions_request(prompt, params, request_id, self._model)
        obj, http_s = await self._generate_json(self._path, payload, timeout_s=timeout_s, request_id=request_id,
                                                prompt_key="token_ids" if self.route == "generate" else "prompt")
        if self.route == "generate":
            ids, logprobs, finish = parse_generate_response(obj, self.address)
            what = "choices[0].token_ids / choices[0].logprobs.content[*].logprob"
        else:
            ids, logprobs, finish = parse_completions_response(obj, self.address)
            what = "choices[0].token_ids / choices[0].logprobs.token_logprobs"
        return checked_result(ids, logprobs, finish, params=params, server=self.address, what=what,
                              request_id=request_id, http_s=http_s)

    async def abort(self, request_id: str) -> None:
        await self._control("POST", "/abort_requests", {"request_ids": [request_id]})

    async def pause(self, mode: str = "keep") -> None:
        if mode not in PAUSE_MODES:
            raise ConfigError(f"pause mode must be one of {sorted(PAUSE_MODES)}, got {mode!r}")
        await self._control("POST", "/pause", params={"mode": mode})

    async def resume(self) -> None:
        await self._control("POST", "/resume")

    def _missing_route_hint(self, path: str) -> str:
        if path == GENERATE_PATH:
            return "this vLLM predates /inference/v1/generate: use the spec vllm-completions+http://..."
        if path in ("/pause", "/resume", "/abort_requests"):
            return "vLLM serves its RL control routes only with VLLM_SERVER_DEV_MODE=1 (and /pause since ~0.12)"
        return "is this a vLLM server?"
