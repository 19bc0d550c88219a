"""vLLM's routes on the reference server: token generation, completions and the RL control plane.

Shapes follow the vLLM documentation summarised in shared/notes/inference_protocols.md (section 1):
``POST /inference/v1/generate``, ``POST /v1/completions`` (token-id prompts, ``return_token_ids``),
``/pause?mode=``, ``/resume``, ``/is_paused``, ``/abort_requests``, ``GET /v1/models``.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from aiohttp import web

from rolloutd.daemon.inference.base import PAUSE_MODES
from rolloutd.daemon.policy.engine import EngineOutput
from rolloutd.daemon.policy.state import (
    MAX_MODEL_LEN,
    STATE,
    PolicyState,
    logprobs_wanted,
    only_sampled_logprob,
    read_json,
    sampling_params,
    token_list,
)
from rolloutd.native_io.errors import BadRequest

VLLM_DEFAULT_MAX_TOKENS = 16


def _usage(out: EngineOutput) -> dict[str, int]:
    n = len(out.token_ids)
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": n, "total_tokens": out.prompt_tokens + n}


async def generate_tokens(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_json(request)
    if body.get("stream"):
        raise BadRequest("stream=true is not supported by the reference server; send stream=false")
    prompt = token_list(body.get("token_ids"), "token_ids")
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise BadRequest("sampling_params must be a JSON object")
    params = sampling_params(sp, max_key="max_tokens", default_max=VLLM_DEFAULT_MAX_TOKENS, seed_key="seed")
    top = logprobs_wanted(sp.get("logprobs"), "sampling_params.logprobs")
    # vLLM 0.32 tracks the request (and aborts it) under this prefixed id.
    rid = f"generate-tokens-{body.get('request_id') or uuid.uuid4().hex}"
    out = await state.run(prompt, dataclasses.replace(params, top_logprobs=top or 0), rid)
    best = out.top or [[] for _ in out.token_ids]
    logprobs = {"content": [{"token_id": t, "logprob": lp,
                             "top_logprobs": [{"token_id": i, "logprob": v} for i, v in alternatives]}
                            for t, lp, alternatives in zip(out.token_ids, out.logprobs, best)]
                } if top is not None else None
    return web.json_response({
        "request_id": rid,
        "model": state.model_name,
        "created": int(time.time()),
        "output_mode": "tokens",
        "choices": [{"index": 0, "finish_reason": out.finish_reason, "stop_reason": None,
                     "token_ids": out.token_ids, "logprobs": logprobs,
                     # Each token's version, as runs: a call across a weight update has several.
                     "weight_versions": [{"version": v, "start": a, "end": b} for v, a, b in out.weight_spans]}],
        "usage": _usage(out),
        "prompt_logprobs": None,
        "kv_transfer_params": None,
    })


def _completion_prompt(state: PolicyState, prompt: Any) -> list[int]:
    if isinstance(prompt, str):
        return state.encode(prompt)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        if len(prompt) != 1:
            raise BadRequest("the reference server takes one prompt per request")
        prompt = prompt[0]
    return token_list(prompt, "prompt")


async def completions(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_json(request)
    if body.get("stream"):
        raise BadRequest("stream=true is not supported by the reference server; send stream=false")
    if body.get("echo"):
        raise BadRequest("echo=true is not supported by the reference server")
    if body.get("n") not in (None, 1):
        raise BadRequest("the reference server generates one choice per request; send n=1")
    prompt = _completion_prompt(state, body.get("prompt"))
    params = sampling_params(body, max_key="max_tokens", default_max=VLLM_DEFAULT_MAX_TOKENS, seed_key="seed")
    with_logprobs = only_sampled_logprob(body.get("logprobs"), "logprobs")
    rid = f"cmpl-{body.get('request_id') or request.headers.get('X-Request-Id') or uuid.uuid4().hex}"
    out = await state.run(prompt, params, rid)

    skip_special = body.get("skip_special_tokens", True) is not False
    text_ids = out.token_ids
    stopped_on = out.token_ids[-1] if out.finish_reason == "stop" and out.token_ids else None
    if stopped_on is not None and not body.get("include_stop_str_in_output", False):
        text_ids = text_ids[:-1]
    choice: dict[str, Any] = {
        "index": 0,
        "text": state.decode(text_ids, skip_special_tokens=skip_special),
        "logprobs": None,
        "finish_reason": out.finish_reason,
        # vLLM names the matched stop token here only for stop_token_ids, not for EOS.
        "stop_reason": stopped_on if stopped_on in params.stop_token_ids else None,
    }
    if with_logprobs:
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        pieces = [f"token_id:{t}" if as_ids else state.decode([t], skip_special_tokens=False)
                  for t in out.token_ids]
        offsets, pos = [], 0
        for piece in pieces:
            offsets.append(pos)
            pos += len(piece)
        choice["logprobs"] = {"tokens": pieces, "token_logprobs": out.logprobs,
                              "top_logprobs": [{p: lp} for p, lp in zip(pieces, out.logprobs)],
                              "text_offset": offsets}
    if body.get("return_token_ids"):
        choice["prompt_token_ids"] = prompt
        choice["token_ids"] = out.token_ids
    return web.json_response({"id": rid, "object": "text_completion", "created": int(time.time()),
                              "model": state.model_name, "choices": [choice], "usage": _usage(out)})


async def pause(request: web.Request) -> web.Response:
    mode = request.query.get("mode", "abort")
    if mode not in PAUSE_MODES:
        raise BadRequest(f"mode must be one of {sorted(PAUSE_MODES)}, got {mode!r}")
    await request.app[STATE].engine.pause(mode)
    return web.json_response({"status": "paused"})


async def resume(request: web.Request) -> web.Response:
    request.app[STATE].engine.resume()
    return web.json_response({"status": "resumed"})


async def is_paused(request: web.Request) -> web.Response:
    return web.json_response({"is_paused": request.app[STATE].engine.is_paused})


async def abort_requests(request: web.Request) -> web.Response:
    body = await read_json(request) if request.can_read_body else {}
    ids = body.get("request_ids") or None
    if ids is not None and not (isinstance(ids, list) and all(isinstance(i, str) for i in ids)):
        raise BadRequest("request_ids must be a list of strings")
    return web.json_response({"status": "aborted", "aborted": request.app[STATE].engine.abort(ids)})


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({"object": "list", "data": [{
        "id": state.model_name, "object": "model", "created": state.created, "owned_by": "rolloutd",
        "root": state.model_name, "parent": None, "max_model_len": MAX_MODEL_LEN,
        "rolloutd": {"scripted": state.scripted is not None, "weight_version": state.engine.weight_version},
    }]})


def add_routes(app: web.Application) -> None:
    app.router.add_post("/inference/v1/generate", generate_tokens)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/pause", pause)
    app.router.add_post("/resume", resume)
    app.router.add_get("/is_paused", is_paused)
    app.router.add_post("/abort_requests", abort_requests)
    app.router.add_post("/inference/v1/abort_requests", abort_requests)
