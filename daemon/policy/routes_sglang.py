"""SGLang's routes on the reference server: ``POST /generate`` and the control endpoints.

Shapes follow the SGLang documentation summarised in shared/notes/inference_protocols.md
(section 2): ``meta_info.output_token_logprobs`` holds ``[logprob, token_id, text|null]`` triples,
``meta_info.finish_reason`` is ``{"type": "stop"|"length"|"abort", ...}`` and
``meta_info.weight_version`` reports the weights that produced the answer.
"""

from __future__ import annotations

import uuid
from typing import Any

from aiohttp import web

from rolloutd.daemon.policy.state import (
    STATE,
    only_sampled_logprob,
    read_json,
    sampling_params,
    token_list,
)
from rolloutd.native_io.errors import BadRequest

SGLANG_DEFAULT_MAX_NEW_TOKENS = 128
# SGLang's in_place keeps running requests with their KV cache and retract re-queues them; the
# reference model keeps no cache, so both freeze requests until /continue_generation.
_PAUSE_MODES = {"in_place": "keep", "retract": "keep", "abort": "abort"}


def _finish_reason(reason: str, token_ids: list[int]) -> dict[str, Any]:
    if reason == "stop":
        return {"type": "stop", "matched": token_ids[-1] if token_ids else None}
    if reason == "length":
        return {"type": "length", "length": len(token_ids)}
    return {"type": "abort", "message": "request aborted"}


async def generate(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = await read_json(request)
    if body.get("stream"):
        raise BadRequest("stream=true is not supported by the reference server; send stream=false")
    if body.get("input_ids") is not None:
        prompt = token_list(body["input_ids"], "input_ids")
    elif isinstance(body.get("text"), str):
        prompt = state.encode(body["text"])
    else:
        raise BadRequest("send input_ids (a list of token ids) or text")
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise BadRequest("sampling_params must be a JSON object")
    params = sampling_params(sp, max_key="max_new_tokens", default_max=SGLANG_DEFAULT_MAX_NEW_TOKENS,
                             seed_key="sampling_seed")
    if body.get("top_logprobs_num"):
        only_sampled_logprob(body["top_logprobs_num"], "top_logprobs_num")
    rid = str(body.get("rid") or uuid.uuid4().hex)
    out = await state.run(prompt, params, rid)
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": _finish_reason(out.finish_reason, out.token_ids),
        "prompt_tokens": out.prompt_tokens,
        "completion_tokens": len(out.token_ids),
        "cached_tokens": 0,
        "weight_version": out.weight_version,
        "e2e_latency": out.e2e_s,
    }
    if body.get("return_logprob"):
        meta["output_token_logprobs"] = [[lp, t, None] for t, lp in zip(out.token_ids, out.logprobs)]
        meta["input_token_logprobs"] = []
    skip_special = sp.get("skip_special_tokens", True) is not False
    text = state.decode(out.token_ids, skip_special_tokens=skip_special)
    return web.json_response({"text": text, "output_ids": out.token_ids, "meta_info": meta})


async def pause_generation(request: web.Request) -> web.Response:
    body = await read_json(request) if request.can_read_body else {}
    mode = body.get("mode", "abort")
    if mode not in _PAUSE_MODES:
        raise BadRequest(f"mode must be one of {sorted(_PAUSE_MODES)}, got {mode!r}")
    await request.app[STATE].engine.pause(_PAUSE_MODES[mode])
    return web.json_response({"success": True, "message": f"generation paused (mode {mode})"})


async def continue_generation(request: web.Request) -> web.Response:
    request.app[STATE].engine.resume()
    return web.json_response({"success": True, "message": "generation continued"})


async def abort_request(request: web.Request) -> web.Response:
    body = await read_json(request)
    engine = request.app[STATE].engine
    if body.get("abort_all"):
        n = engine.abort(None)
    elif isinstance(body.get("rid"), str):
        n = engine.abort([body["rid"]])
    else:
        raise BadRequest('send {"rid": "<request id>"} or {"abort_all": true}')
    return web.json_response({"success": True, "message": f"aborted {n} request(s)"})


async def get_model_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response({
        "model_path": state.model_name,
        "tokenizer_path": str(state.tokenizer_dir),
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": state.engine.weight_version,
        "scripted": state.scripted is not None,
    })


def add_routes(app: web.Application) -> None:
    app.router.add_post("/generate", generate)
    app.router.add_post("/pause_generation", pause_generation)
    app.router.add_post("/continue_generation", continue_generation)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_get("/get_model_info", get_model_info)
