"""Every error of the OpenAI proxy in OpenAI's shape, with the status the official ``openai`` SDK
maps to the right exception, the HTTP layer's too (404, 405, 413); bad input is a 4xx, never a
500 the SDK would retry: named cases, then request bodies fuzzed with hypothesis."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from openai_proxy_inprocess import KEY, MODEL, conversation, httpx, proxy, turn

ERROR_KEYS = {"message", "type", "param", "code"}


def error_of(answer: Any) -> dict[str, Any]:
    body = answer.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


async def test_http_errors_are_in_openais_shape_and_map_to_the_sdks_exceptions(short_tmp: Path) -> None:
    async with proxy(short_tmp, max_body_bytes=1 << 20) as p:
        with pytest.raises(openai.NotFoundError) as e:
            await p.client.completions.create(model=MODEL, prompt="Hello")
        assert e.value.code == "unsupported_endpoint" and "/v1/chat/completions" in e.value.message
        async with p.raw() as raw:
            answers = {404: await raw.post("/v1/embeddings", json={"input": "x"}),
                       405: await raw.get("/v1/chat/completions"),
                       413: await raw.post("/v1/chat/completions", content=b"x" * (2 << 20))}
        for status, answer in answers.items():
            assert answer.status_code == status and error_of(answer)["code"]
        with pytest.raises(openai.APIStatusError) as e:
            await p.client.chat.completions.create(model=MODEL, messages=[
                {"role": "user", "content": "x" * (2 << 20)}])
        assert e.value.status_code == 413
        assert p.results == []


BAD_BODIES = {
    "role as list": {"messages": [{"role": ["user"], "content": "hi"}]},
    "role as dict": {"messages": [{"role": {"name": "user"}, "content": "hi"}]},
    "content as dict": {"messages": [{"role": "user", "content": {"text": "hi"}}]},
    "tool call as string": {"messages": [*conversation(), {"role": "assistant", "tool_calls": ["x"]},
                                         {"role": "user", "content": "hi"}]},
    "tools as dict": {"tools": {"type": "function"}},
    "stop as number": {"stop": 5},
    "stream as string": {"stream": "yes"},
    "stream_options as list": {"stream_options": [1]},
}


async def test_bad_input_is_a_400_naming_what_is_wrong(short_tmp: Path) -> None:
    async with proxy(short_tmp) as p:
        for name, fields in BAD_BODIES.items():
            with pytest.raises(openai.BadRequestError) as e:
                await p.client.chat.completions.create(**{"model": MODEL, "messages": conversation(), **fields})
            assert e.value.param, name
        async with p.raw() as raw:
            deep = b'{"model": "m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
            answer = await raw.post("/v1/chat/completions", content=deep)
            assert answer.status_code == 400 and "deeply" in error_of(answer)["message"]
        assert p.results == []
        # And the proxy still serves.
        assert (await turn(p, conversation())).message.content == "I will list the files."


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                    max_leaves=12)
FIELDS = ["model", "messages", "tools", "tool_choice", "parallel_tool_calls", "stop", "stream", "stream_options",
          "max_tokens", "max_completion_tokens", "n", "logprobs", "top_logprobs", "response_format", "functions",
          "temperature", "user"]
MESSAGE = st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(["system", "user", "assistant", "tool", "developer", "robot"]) | JSON,
    "content": st.text(max_size=12) | JSON, "tool_calls": JSON, "tool_call_id": JSON, "name": JSON})
BODY = st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6).flatmap(
    lambda extra: st.builds(lambda messages: {"model": MODEL, **extra, "messages": messages},
                            st.lists(MESSAGE, min_size=1, max_size=4) | JSON))


async def test_fuzzed_bodies_are_never_a_server_error(short_tmp: Path) -> None:
    seen: dict[int, int] = {}
    async with proxy(short_tmp, max_requests=100_000, max_tokens_per_turn=2) as p:
        def fuzz() -> None:
            with httpx.Client(transport=httpx.HTTPTransport(uds=str(p.socket)), base_url="http://localhost",
                              headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as raw:
                @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
                @given(BODY, st.booleans())
                def one(body: dict[str, Any], as_text: bool) -> None:
                    content = json.dumps(body).encode() if as_text else json.dumps(body)[:-1].encode()
                    answer = raw.post("/v1/chat/completions", content=content)
                    seen[answer.status_code] = seen.get(answer.status_code, 0) + 1
                    assert answer.status_code in (200, 400), (answer.status_code, answer.text[:500])
                    if answer.status_code == 400:
                        error_of(answer)
                    p.session.stop_reason = None  # a context or turn limit would refuse every later body

                one()

        await asyncio.to_thread(fuzz)
    assert seen.get(400, 0) > 50, seen
