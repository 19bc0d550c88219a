"""Each backend against the reference server over real HTTP, and against servers that answer
wrongly on purpose: every bad answer must become a clear error, never a shortened trajectory."""

from __future__ import annotations

import asyncio
import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest
from inference_support import API_KEY, PROMPT, BadServer, max_logprob_error, policy_server, wait_until
from support.loop import run

from rolloutd.daemon.inference.base import SamplingParams
from rolloutd.daemon.inference.growing_ids import GrowingIds
from rolloutd.daemon.inference.factory import detect_protocol, make_backend, parse_spec
from rolloutd.daemon.inference.sglang_http import SGLangHTTPBackend
from rolloutd.daemon.inference.vllm_http import VLLMHTTPBackend
from rolloutd.daemon.inference.vllm_inprocess import import_vllm, result_from_request_output
from rolloutd.native_io.errors import (
    ConfigError,
    InferenceError,
    InferenceProtocolError,
    InferenceRejected,
    InferenceTimeout,
    MissingDependency,
)

KINDS = ["vllm-generate", "vllm-completions", "sglang"]


def backend_for(kind: str, url: str, api_key: str | None = API_KEY) -> VLLMHTTPBackend | SGLangHTTPBackend:
    if kind == "sglang":
        return SGLangHTTPBackend(url, api_key=api_key)
    return VLLMHTTPBackend(url, route=kind.removeprefix("vllm-"), api_key=api_key)


@pytest.mark.parametrize("kind", KINDS)
def test_backend_generates_with_true_logprobs(kind: str) -> None:
    async def scenario() -> None:
        async with policy_server(weight_version="3") as srv:
            backend = backend_for(kind, srv.url)
            try:
                params = SamplingParams(max_tokens=40, seed=11)
                first = await backend.generate(PROMPT, params, request_id="r1", timeout_s=10)
                again = await backend.generate(PROMPT, params, request_id="r2", timeout_s=10)
                # A trajectory's context grows turn by turn and goes out as its own JSON text.
                grown = GrowingIds(PROMPT[:3])
                grown.extend(np.asarray(PROMPT[3:]))
                from_grown = await backend.generate(grown, params, request_id="r3", timeout_s=10)
            finally:
                await backend.close()
        assert first.token_ids.dtype == np.int32 and first.logprobs.dtype == np.float32
        assert len(first.token_ids) == len(first.logprobs) >= 1
        assert first.finish_reason in ("stop", "length")
        if first.finish_reason == "length":
            assert len(first.token_ids) == 40
        else:
            assert first.token_ids[-1] in (0, 2)  # the stop token is part of the output
        np.testing.assert_array_equal(first.token_ids, again.token_ids)  # same seed, same sample
        np.testing.assert_array_equal(first.token_ids, from_grown.token_ids)
        np.testing.assert_array_equal(first.logprobs, from_grown.logprobs)
        assert max_logprob_error(PROMPT, first) <= 1e-5
        assert first.server == srv.url
        # SGLang and vLLM's generate route (0.32: per-token spans) report the server's version;
        # vLLM's completions route reports none and leaves it to the pool.
        assert first.weight_version == ("" if kind == "vllm-completions" else "3")
        if kind == "vllm-generate":
            assert [(s.version, s.start, s.end) for s in first.weight_spans] == [("3", 0, len(first.token_ids))]
    run(scenario())


@pytest.mark.parametrize("kind", KINDS)
def test_max_tokens_gives_length_and_stop_ids_give_stop(kind: str) -> None:
    async def scenario() -> None:
        async with policy_server() as srv:
            backend = backend_for(kind, srv.url)
            try:
                short = await backend.generate(PROMPT, SamplingParams(max_tokens=3, seed=1), request_id="a",
                                               timeout_s=10)
                seed = 0
                while (full := await backend.generate(PROMPT, SamplingParams(max_tokens=5, seed=seed),
                                                      request_id=f"b{seed}", timeout_s=10)).finish_reason != "length":
                    seed += 1
                # Stop on the sample's third token: the same seeded sample must end right there,
                # the stop token included.
                stop_at = int(full.token_ids[2])
                end = full.token_ids.tolist().index(stop_at) + 1
                stop_params = SamplingParams(max_tokens=5, seed=seed, stop_token_ids=(stop_at,))
                stopped = await backend.generate(PROMPT, stop_params, request_id="c", timeout_s=10)
            finally:
                await backend.close()
        assert (len(short.token_ids), short.finish_reason) == (3, "length")
        assert stopped.finish_reason == "stop"
        np.testing.assert_array_equal(stopped.token_ids, full.token_ids[:end])
    run(scenario())


@pytest.mark.parametrize("protocol,expected", [("both", "vllm-generate"), ("sglang", "sglang")])
def test_protocol_detection_against_reference_server(protocol: str, expected: str) -> None:
    async def scenario() -> None:
        async with policy_server(protocol=protocol) as srv:
            assert await detect_protocol(srv.url, api_key=API_KEY) == expected
            backend = await make_backend(srv.url, api_key=API_KEY)
            try:
                assert backend.kind == expected
                result = await backend.generate(PROMPT, SamplingParams(max_tokens=4), request_id="d", timeout_s=10)
                assert len(result.token_ids) == len(result.logprobs) >= 1
            finally:
                await backend.close()
            with pytest.raises(InferenceRejected, match="api_key"):
                await detect_protocol(srv.url, api_key="wrong")
    run(scenario())


def test_detection_falls_back_to_completions() -> None:
    async def scenario() -> None:
        async with BadServer("ok", completions_only=True) as old_vllm:
            assert await detect_protocol(old_vllm.url) == "vllm-completions"
            for spec in (old_vllm.url, "vllm+" + old_vllm.url):
                backend = await make_backend(spec)
                try:
                    assert backend.kind == "vllm-completions"
                    result = await backend.generate(PROMPT, SamplingParams(max_tokens=4), request_id="c", timeout_s=5)
                    assert result.token_ids.tolist() == [5, 6, 2]
                finally:
                    await backend.close()
            # A forced generate route on such a server says what to do instead.
            backend = VLLMHTTPBackend(old_vllm.url, route="generate")
            try:
                with pytest.raises(InferenceProtocolError, match="vllm-completions"):
                    await backend.generate(PROMPT, SamplingParams(max_tokens=4), request_id="g", timeout_s=5)
            finally:
                await backend.close()


def test_spec_parsing() -> None:
    assert parse_spec("vllm+http://127.0.0.1:8000/") == ("vllm", "http://127.0.0.1:8000")
    assert parse_spec("sglang+http://h:30000") == ("sglang", "http://h:30000")
    assert parse_spec("http://h:1") == ("auto", "http://h:1")
    assert parse_spec("vllm-inprocess:/models/q") == ("vllm-inprocess", "/models/q")
    for bad in ("tcp://h:1", "vllm+ftp://h", "vllm-inprocess:", "h:8000"):
        with pytest.raises(ConfigError, match="spec|vllm-inprocess"):
            parse_spec(bad)


BAD_CASES = [
    ("http500", InferenceError, "HTTP 500.*CUDA error"),
    ("truncated", InferenceProtocolError, "not valid JSON"),
    ("no_logprobs", InferenceProtocolError, "without log-probabilities"),
    ("short_logprobs", InferenceProtocolError, "log-?prob"),
    ("too_many", InferenceProtocolError, "100 tokens for max_tokens=8"),
    ("wrong_token", InferenceProtocolError, "disagree|no log-probability for generated token 1|differ"),
    ("disconnect", InferenceError, "failed"),
    ("unauthorized", InferenceRejected, "credentials"),
    ("bad_request", InferenceRejected, "max_tokens is too large"),
    # Valid to Python's json, not to strict parsers: read, then refused for what it holds.
    ("nan_logprob", InferenceProtocolError, "not finite"),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode,error,message", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_answers_raise_clear_errors(kind: str, mode: str, error: type[Exception], message: str) -> None:
    async def scenario() -> None:
        async with BadServer(mode) as bad:
            backend = backend_for(kind, bad.url)
            try:
                with pytest.raises(error, match=message) as info:
                    await backend.generate(PROMPT, SamplingParams(max_tokens=8), request_id="bad", timeout_s=5)
            finally:
                await backend.close()
            assert bad.url in str(info.value)
            if error is InferenceError:
                assert not isinstance(info.value, (InferenceProtocolError, InferenceRejected))
    run(scenario())


@pytest.mark.parametrize("kind", KINDS)
def test_bad_server_ok_answer_is_accepted(kind: str) -> None:
    """The misbehaving server's well-formed answer parses, so the failures above are about the faults."""
    async def scenario() -> None:
        async with BadServer("ok") as bad:
            backend = backend_for(kind, bad.url)
            try:
                result = await backend.generate(PROMPT, SamplingParams(max_tokens=8), request_id="ok", timeout_s=5)
            finally:
                await backend.close()
        assert result.token_ids.tolist() == [5, 6, 2]
        np.testing.assert_allclose(result.logprobs, [-1.0, -2.0, -0.5])
        assert result.weight_version == ("7" if kind == "sglang" else "")
    run(scenario())


@pytest.mark.parametrize("kind", KINDS)
def test_hang_past_deadline_times_out_and_aborts(kind: str) -> None:
    async def scenario() -> None:
        async with BadServer("hang") as bad:
            backend = backend_for(kind, bad.url)
            try:
                with pytest.raises(InferenceTimeout, match="within 0.3s") as info:
                    await backend.generate(PROMPT, SamplingParams(max_tokens=8), request_id="slow-1", timeout_s=0.3)
                assert isinstance(info.value, TimeoutError)
                await wait_until(lambda: bad.aborted == ["slow-1"] and bad.hanging == 0, what="abort sent")
            finally:
                await backend.close()
    run(scenario())


def test_connection_refused_is_a_server_failure() -> None:
    async def scenario() -> None:
        async with BadServer("ok") as bad:
            url = bad.url
        backend = VLLMHTTPBackend(url, api_key=API_KEY, connect_timeout_s=2)
        try:
            with pytest.raises(InferenceError, match="may be down"):
                await backend.generate(PROMPT, SamplingParams(max_tokens=4), request_id="x", timeout_s=5)
            assert not await backend.health()
        finally:
            await backend.close()
    run(scenario())


@pytest.mark.parametrize("kind", KINDS)
def test_cancel_aborts_on_the_server(kind: str) -> None:
    async def scenario() -> None:
        async with policy_server(slots=4, ms_per_token=20) as srv:
            backend = backend_for(kind, srv.url)
            try:
                call = asyncio.create_task(backend.generate(PROMPT, SamplingParams(max_tokens=500, ignore_eos=True),
                                                            request_id="cancel-me", timeout_s=30))
                await wait_until(lambda: srv.engine.running == 1, what="request running")
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call
                await wait_until(lambda: srv.engine.running == 0 and srv.engine.waiting == 0, what="request aborted")
            finally:
                await backend.close()
    run(scenario())


def test_pause_and_resume_through_each_backend() -> None:
    async def scenario() -> None:
        async with policy_server() as srv:
            for kind in KINDS:
                backend = backend_for(kind, srv.url)
                try:
                    await backend.pause("keep")
                    assert srv.engine.is_paused
                    await backend.resume()
                    assert not srv.engine.is_paused
                    assert await backend.health()
                finally:
                    await backend.close()
    run(scenario())


def test_sglang_has_no_wait_pause() -> None:
    async def scenario() -> None:
        backend = SGLangHTTPBackend("http://127.0.0.1:9")
        with pytest.raises(ConfigError, match="no 'wait'"):
            await backend.pause("wait")
        await backend.close()
    run(scenario())


class _Logprob:
    def __init__(self, logprob: float) -> None:
        self.logprob = logprob
        self.rank = 1


def _request_output(ids: list[int], positions: list[dict[int, _Logprob]] | None,
                    finish: str | None = "stop") -> SimpleNamespace:
    """Shaped like vllm.RequestOutput (outputs[0] is a CompletionOutput)."""
    completion = SimpleNamespace(index=0, text="", token_ids=ids, cumulative_logprob=None, logprobs=positions,
                                 finish_reason=finish, stop_reason=None)
    return SimpleNamespace(request_id="r", prompt_token_ids=[1, 2], outputs=[completion], finished=True)


def test_vllm_inprocess_conversion() -> None:
    params = SamplingParams(max_tokens=8)
    # logprobs=0 returns the sampled token's entry; vLLM may add a higher-ranked alternative too.
    out = _request_output([5, 9, 2], [{5: _Logprob(-0.5)}, {9: _Logprob(-2.25), 4: _Logprob(-0.1)},
                                      {2: _Logprob(-0.01)}])
    result = result_from_request_output(out, params=params, server="vllm-inprocess:m", request_id="r")
    assert result.token_ids.tolist() == [5, 9, 2]
    np.testing.assert_allclose(result.logprobs, [-0.5, -2.25, -0.01], rtol=1e-6)
    assert result.finish_reason == "stop"
    with pytest.raises(InferenceProtocolError, match="without log-probabilities"):
        result_from_request_output(_request_output([5, 9], None), params=params, server="s", request_id="r")
    with pytest.raises(InferenceProtocolError, match="no log-probability for generated token 1"):
        result_from_request_output(_request_output([5, 9], [{5: _Logprob(-0.5)}, {4: _Logprob(-0.1)}]),
                                   params=params, server="s", request_id="r")
    with pytest.raises(InferenceProtocolError, match="2 token ids but 1"):
        result_from_request_output(_request_output([5, 9], [{5: _Logprob(-0.5)}]), params=params, server="s",
                                   request_id="r")
    with pytest.raises(InferenceProtocolError, match="finish reason"):
        result_from_request_output(_request_output([5], [{5: _Logprob(-0.5)}], finish=None), params=params,
                                   server="s", request_id="r")


def test_vllm_inprocess_import_is_lazy_with_a_clear_error() -> None:
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(MissingDependency, match=r"pip install 'rolloutd\[vllm\]'") as info:
            import_vllm()
        assert isinstance(info.value, ImportError)

        async def scenario() -> None:
            with pytest.raises(MissingDependency, match="needs vLLM"):
                await make_backend("vllm-inprocess:/models/none")
        run(scenario())
    else:
        assert import_vllm().AsyncLLM is not None
