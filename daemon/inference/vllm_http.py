"""vLLM over HTTP, token ids in and out (shared/notes/inference_protocols.md, section 1).

Two routes, chosen per server (:mod:`rolloutd.daemon.inference.factory` detects which one it has):
- ``generate``: ``POST /inference/v1/generate`` with ``token_ids`` and ``sampling_params``
  (explicit ``max_tokens``, ``logprobs: k`` with ``k = params.top_logprobs``, ``detokenize: false``);
  ids from ``choices[0].token_ids``, log-probabilities from ``choices[0].logprobs.content[*].logprob``,
  the top k from ``content[*].top_logprobs``.
- ``completions``: ``POST /v1/completions`` with ``prompt`` as a list of ints, ``return_token_ids``,
  ``logprobs: 0`` (its top log-probabilities are keyed by token text: none are asked for),
  ``skip_special_tokens: false``, ``include_stop_str_in_output: true``; ids from
  ``choices[0].token_ids``, log-probabilities from ``choices[0].logprobs.token_logprobs``.

Weight versions: vLLM 0.32's generate route reports per-token ``choices[0].weight_versions``
spans, which each result carries; the completions route reports none, and the pool records the
version it was told. The server's ``max_model_len`` is read from ``/v1/models`` when the backend
is made (:meth:`VLLMHTTPBackend.discover`), so agents can budget their context.

Pause and resume use the RL control routes (``/pause?mode=``, ``/resume``), which vLLM serves only
with ``VLLM_SERVER_DEV_MODE=1``. A cancelled or timed-out call closes its connection, which makes
vLLM drop the request, and an abort is sent as well, under the id vLLM tracks the request by:
``generate-tokens-<id>`` at ``/inference/v1/abort_requests`` for the generate route (0.32), and
``cmpl-<id>`` at the dev-mode ``/abort_requests`` for completions.
"""

from __future__ import annotations

import logging
import operator
from typing import Any
from collections.abc import Sequence

import numpy as np

from rolloutd.daemon.inference.base import PAUSE_MODES, GenerateResult, SamplingParams, checked_result
from rolloutd.daemon.inference.http_backend import HTTPBackend, prompt_list
from rolloutd.native_io.errors import ConfigError, InferenceProtocolError

logger = logging.getLogger(__name__)

GENERATE_PATH = "/inference/v1/generate"
GENERATE_ABORT_PATH = "/inference/v1/abort_requests"
# The prefixes vLLM's serving layers put before a client's request id (serving.py of each route).
INTERNAL_ID_PREFIX = {"generate": "generate-tokens-", "completions": "cmpl-"}
COMPLETIONS_PATH = "/v1/completions"
ROUTES = {"generate": GENERATE_PATH, "completions": COMPLETIONS_PATH}


def _sampling_fields(params: SamplingParams, top_logprobs: int = 0) -> dict[str, Any]:
    # logprobs=k: the sampled token's log-probability (vLLM always includes it) and the k most likely.
    return {**params.wire_fields(max_key="max_tokens", seed_key="seed"), "logprobs": top_logprobs}


def generate_request(prompt: list[int], params: SamplingParams, request_id: str,
                     model: str | None = None) -> dict[str, Any]:
    sampling = _sampling_fields(params, params.top_logprobs)
    sampling["detokenize"] = False
    body: dict[str, Any] = {"request_id": request_id, "token_ids": prompt, "sampling_params": sampling,
                            "stream": False}
    if model:
        body["model"] = model
    return body


def completions_request(prompt: list[int], params: SamplingParams, request_id: str,
                        model: str | None = None) -> dict[str, Any]:
    # Its top log-probabilities are keyed by token text, not id: none are asked for.
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


def _entry_id(entry: Any) -> Any:
    # 0.32 gives each entry its integer "token_id"; older builds named it "token_id:N".
    if not isinstance(entry, dict):
        return None
    name = entry.get("token")
    if "token_id" in entry:
        return entry["token_id"]
    return int(name[9:]) if isinstance(name, str) and name.startswith("token_id:") and name[9:].isdigit() else name


def _field(content: list[Any], key: str) -> list[Any]:
    """``entry[key]`` of every entry, None where an entry is not an object or lacks it."""
    try:
        return list(map(operator.itemgetter(key), content))  # a third of a comprehension's time
    except (TypeError, KeyError):
        return [entry.get(key) if isinstance(entry, dict) else None for entry in content]


def parse_top_logprobs(content: list[Any]) -> list[list[tuple[Any, Any]]]:
    """Per generated token, its ``top_logprobs`` entries as (id, log-probability), unchecked."""
    out: list[list[tuple[Any, Any]]] = []
    for entry in content:
        top = entry.get("top_logprobs") if isinstance(entry, dict) else None
        out.append([(_entry_id(t), t.get("logprob")) for t in top if isinstance(t, dict)] if top else [])
    return out


def parse_generate_response(obj: dict[str, Any], server: str, *, top: bool = False) -> tuple[Any, Any, Any, Any, Any]:
    """(ids, logprobs, finish_reason, weight_versions, top logprobs) from a
    ``/inference/v1/generate`` answer, unchecked; the top log-probabilities only where ``top``
    (asked for: otherwise a pass over every token for nothing), else None."""
    choice = _first_choice(obj, server)
    ids = choice.get("token_ids")
    lp = choice.get("logprobs")
    content = lp.get("content") if isinstance(lp, dict) else None
    versions = choice.get("weight_versions")
    if not isinstance(content, list):
        return ids, None, choice.get("finish_reason"), versions, None
    logprobs, named = _field(content, "logprob"), _field(content, "token_id")
    # The usual answer names each entry's id as the same integer (checked in one comparison);
    # anything else is looked at entry by entry.
    if isinstance(ids, list) and len(ids) == len(content) and (named != ids or None in ids):
        for k, (entry, tok) in enumerate(zip(content, ids)):
            if not isinstance(entry, dict):
                continue
            entry_id = _entry_id(entry)
            if isinstance(entry_id, int) and entry_id != tok:
                raise InferenceProtocolError(f"{server}: log-probability {k} is for token {entry_id} but "
                                             f"token_ids[{k}] is {tok}; the answer's ids and log-probabilities "
                                             "disagree")
    return ids, logprobs, choice.get("finish_reason"), versions, parse_top_logprobs(content) if top else None


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
        self._spans_ignored = False

    async def generate(self, prompt_ids: Sequence[int] | np.ndarray, params: SamplingParams, *,
                       request_id: str, timeout_s: float) -> GenerateResult:
        prompt = prompt_list(prompt_ids)
        if self.route == "generate":
            payload = generate_request(prompt, params, request_id, self._model)
        else:
            payload = completions_request(prompt, params, request_id, self._model)
        obj, http_s = await self._generate_json(self._path, payload, timeout_s=timeout_s, request_id=request_id,
                                                prompt_key="token_ids" if self.route == "generate" else "prompt")
        versions = top = None
        if self.route == "generate":
            ids, logprobs, finish, versions, top = parse_generate_response(obj, self.address,
                                                                           top=params.top_logprobs > 0)
            what = "choices[0].token_ids / choices[0].logprobs.content[*].logprob"
        else:
            ids, logprobs, finish = parse_completions_response(obj, self.address)
            what = "choices[0].token_ids / choices[0].logprobs.token_logprobs"
        return checked_result(ids, logprobs, finish, params=params, server=self.address, what=what,
                              request_id=request_id, http_s=http_s,
                              weight_spans=None if self._spans_ignored else versions, top=top)

    async def discover(self) -> None:
        """Read the server's context window from ``/v1/models`` (None where it gives none)."""
        obj = await self._control("GET", "/v1/models")
        models = obj.get("data")
        entry = next((m for m in models if not self._model or m.get("id") == self._model), None) \
            if isinstance(models, list) else None
        limit = entry.get("max_model_len") if isinstance(entry, dict) else None
        self.max_model_len = limit if isinstance(limit, int) and limit > 0 else None

    async def set_weight_version(self, version: str) -> None:
        try:
            await self._control("POST", "/update_weight_version", {"new_version": version})
        except InferenceProtocolError as e:
            # No route (no VLLM_SERVER_DEV_MODE, or before 0.32): its spans would keep saying the
            # old label, so they are ignored and the pool's recorded version stands instead.
            if not self._spans_ignored:
                logger.warning("%s cannot be told the weight version (%s); recording it in the pool", self.address, e)
            self._spans_ignored = True

    async def abort(self, request_id: str) -> None:
        path = GENERATE_ABORT_PATH if self.route == "generate" else "/abort_requests"
        await self._control("POST", path, {"request_ids": [INTERNAL_ID_PREFIX[self.route] + request_id]})

    async def pause(self, mode: str = "keep") -> None:
        if mode not in PAUSE_MODES:
            raise ConfigError(f"pause mode must be one of {sorted(PAUSE_MODES)}, got {mode!r}")
        await self._control("POST", "/pause", params={"mode": mode})

    async def resume(self) -> None:
        await self._control("POST", "/resume")

    def _missing_route_hint(self, path: str) -> str:
        if path == GENERATE_PATH:
            return "this vLLM predates /inference/v1/generate: use the spec vllm-completions+http://..."
        if path in ("/pause", "/resume", "/abort_requests", GENERATE_ABORT_PATH):
            return "vLLM serves its RL control routes only with VLLM_SERVER_DEV_MODE=1 (and /pause since ~0.12)"
        return "is this a vLLM server?"
