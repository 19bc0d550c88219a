"""What every route of the policy server shares, and the request-body helpers they all use."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable

from aiohttp import web
from tokenizers import Tokenizer

from rolloutd.daemon.inference.base import MAX_TOP_LOGPROBS, SamplingParams
from rolloutd.daemon.policy.engine import EngineOutput, EngineRequest, PolicyEngine
from rolloutd.daemon.policy.scripted import ScriptedReplies
from rolloutd.daemon.policy.tokenizer import SpecialIds
from rolloutd.native_io.errors import BadRequest, ConfigError

MAX_MODEL_LEN = 32768


@dataclass
class PolicyState:
    engine: PolicyEngine
    tokenizer: Tokenizer
    tokenizer_dir: Path
    special: SpecialIds
    scripted: ScriptedReplies | None
    model_name: str
    created: int

    async def run(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> EngineOutput:
        if len(prompt_ids) + params.max_tokens > MAX_MODEL_LEN:
            raise BadRequest(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) "
                             f"exceeds the model's maximum context length of {MAX_MODEL_LEN} tokens")
        forced = self.scripted.forced_tokens(prompt_ids) if self.scripted is not None else None
        return await self.engine.generate(EngineRequest(prompt_ids=prompt_ids, params=params,
                                                        request_id=request_id, forced=forced))

    def decode(self, ids: list[int], *, skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids


STATE: web.AppKey[PolicyState] = web.AppKey("policy_state", PolicyState)


async def read_json(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def token_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise BadRequest(f"{name} must be a list of integer token ids")
    return value


def sampling_params(body: dict[str, Any], *, max_key: str, default_max: int, seed_key: str) -> SamplingParams:
    """Build :class:`SamplingParams` from a protocol's sampling fields (None means default)."""
    def get(key: str, default: Any) -> Any:
        value = body.get(key)
        return default if value is None else value

    top_k = get("top_k", -1)
    try:
        return SamplingParams(
            max_tokens=get(max_key, default_max),
            temperature=float(get("temperature", 1.0)),
            top_p=float(get("top_p", 1.0)),
            top_k=-1 if top_k == 0 else top_k,
            seed=body.get(seed_key),
            stop_token_ids=tuple(get("stop_token_ids", ())),
            ignore_eos=bool(get("ignore_eos", False)),
        )
    except (ConfigError, TypeError, ValueError) as e:
        raise BadRequest(f"bad sampling parameters: {e}") from e


def only_sampled_logprob(k: Any, name: str) -> bool:
    """Whether the caller asked for log-probabilities; for routes that report only the sampled
    token's, so k > 0 is refused."""
    if k is None or k is False:
        return False
    if k is True or k == 0:
        return True
    raise BadRequest(f"{name}={k!r}: this route of the reference server returns only the sampled token's "
                     f"log-probability; send {name}=0")


def logprobs_wanted(k: Any, name: str) -> int | None:
    """None (no log-probabilities), or how many top alternatives to report beside the sampled
    token's (``k``, 0 to MAX_TOP_LOGPROBS)."""
    if k is None or k is False:
        return None
    if k is True:
        return 0
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS:
        raise BadRequest(f"{name}={k!r}: must be an integer from 0 to {MAX_TOP_LOGPROBS}")
    return k


@web.middleware
async def error_middleware(request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
    """A BadRequest from a handler becomes a 400 with vLLM's error body (SGLang clients read the
    same ``message`` field)."""
    try:
        return await handler(request)
    except BadRequest as e:
        body = {"object": "error", "message": e.message, "type": "BadRequestError", "param": None, "code": 400}
        return web.json_response(body, status=400)
