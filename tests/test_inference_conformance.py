"""Conformance with the documented vLLM and SGLang wire formats (fixtures in fixtures/inference,
written from shared/notes/inference_protocols.md): what our clients send, what they accept, and
what the reference server answers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from inference_support import API_KEY, policy_server
from support.loop import run

from rolloutd.daemon.inference import sglang_http, vllm_http
from rolloutd.daemon.inference.base import SamplingParams, checked_result
from rolloutd.native_io.errors import InferenceProtocolError

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "inference"
FIELDS: dict[str, list[str]] = json.loads((FIXTURES / "documented_fields.json").read_text())
PARAMS = SamplingParams(max_tokens=64, temperature=0.8, top_p=0.95, top_k=40, seed=3, stop_token_ids=(7,),
                        ignore_eos=True)


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / f"{name}.json").read_text())


MAPS = ("logprobs.top_logprobs[0]",)
"""Objects whose keys are data (completions' top_logprobs maps token text to log-probability)."""


def assert_shape_includes(ours: Any, documented: Any, path: str = "$") -> None:
    """Every key of the documented example is in ours, with the same JSON type, recursively."""
    if path.endswith(MAPS):
        assert isinstance(ours, dict) and all(isinstance(v, (int, float)) for v in ours.values()), path
        return
    if documented is None:
        return  # null in an example says nothing about the type
    if isinstance(documented, bool) or isinstance(ours, bool):
        assert isinstance(ours, bool) and isinstance(documented, bool), path
    elif isinstance(documented, (int, float)):
        assert isinstance(ours, (int, float)), f"{path}: {ours!r} is not a number"
    elif isinstance(documented, str):
        assert isinstance(ours, str), f"{path}: {ours!r} is not a string"
    elif isinstance(documented, list):
        assert isinstance(ours, list), f"{path}: {ours!r} is not a list"
        if documented and ours:
            assert_shape_includes(ours[0], documented[0], path + "[0]")
    else:
        assert isinstance(ours, dict), f"{path}: {ours!r} is not an object"
        for key, value in documented.items():
            assert key in ours, f"{path}.{key} is missing"
            assert_shape_includes(ours[key], value, f"{path}.{key}")


# --- what our clients send -------------------------------------------------------------------


def test_vllm_generate_request_matches_the_documented_shape() -> None:
    body = vllm_http.generate_request([1, 2, 3], PARAMS, "req-1")
    assert set(body) <= set(FIELDS["vllm_generate_request"])
    assert set(body["sampling_params"]) <= set(FIELDS["vllm_sampling_params"])
    assert_shape_includes(body, {k: v for k, v in fixture("vllm_generate_request").items() if k != "model"})
    sp = body["sampling_params"]
    assert (sp["max_tokens"], sp["logprobs"], sp["detokenize"]) == (64, 0, False)
    assert body["token_ids"] == [1, 2, 3] and body["request_id"] == "req-1" and body["stream"] is False


def test_vllm_completions_request_matches_the_documented_shape() -> None:
    body = vllm_http.completions_request([1, 2, 3], PARAMS, "req-2")
    assert set(body) <= set(FIELDS["vllm_completions_request"])
    assert_shape_includes(body, {k: v for k, v in fixture("vllm_completions_request").items() if k != "model"})
    assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 64 and body["logprobs"] == 0
    assert body["return_token_ids"] is True and body["skip_special_tokens"] is False
    assert body["include_stop_str_in_output"] is True


def test_sglang_generate_request_matches_the_documented_shape() -> None:
    body = sglang_http.generate_request([1, 2, 3], PARAMS, "req-3")
    assert set(body) <= set(FIELDS["sglang_generate_request"])
    assert set(body["sampling_params"]) <= set(FIELDS["sglang_sampling_params"])
    assert_shape_includes(body, fixture("sglang_generate_request"))
    assert body["sampling_params"]["max_new_tokens"] == 64 and "max_tokens" not in body["sampling_params"]
    assert body["return_logprob"] is True and body["input_ids"] == [1, 2, 3]


# --- what our clients accept -----------------------------------------------------------------


@pytest.mark.parametrize("name,parse", [
    ("vllm_generate_response", lambda obj, server: vllm_http.parse_generate_response(obj, server)[:3]),
    ("vllm_completions_response", vllm_http.parse_completions_response),
    ("sglang_generate_response", lambda obj, server: sglang_http.parse_generate_response(obj, server)[:3]),
])
def test_documented_responses_parse_to_ids_and_logprobs(name: str, parse: Any) -> None:
    ids, logprobs, finish = parse(fixture(name), "server")
    result = checked_result(ids, logprobs, finish, params=SamplingParams(max_tokens=8), server="server", what=name)
    assert result.token_ids.tolist() == [19, 151645]
    np.testing.assert_allclose(result.logprobs, [-0.02, -0.001], rtol=1e-6)
    assert result.finish_reason == "stop"


def test_vllm_weight_versions_become_the_results_spans() -> None:
    ids, logprobs, finish, spans, _ = vllm_http.parse_generate_response(fixture("vllm_generate_response"), "v")
    result = checked_result(ids, logprobs, finish, params=SamplingParams(max_tokens=8), server="v", what="x",
                            weight_spans=spans)
    assert result.weight_version == "step-3" and [(s.version, s.start, s.end) for s in result.weight_spans] == [
        ("step-3", 0, 2)]
    for bad in ([{"version": "a", "start": 0, "end": 1}], [{"version": "a", "start": 1, "end": 2}], [{"v": 1}]):
        with pytest.raises(InferenceProtocolError, match="weight"):
            checked_result(ids, logprobs, finish, params=SamplingParams(max_tokens=8), server="v", what="x",
                           weight_spans=bad)


def test_sglang_documented_weight_version_is_read() -> None:
    assert sglang_http.parse_generate_response(fixture("sglang_generate_response"), "s")[3] == "default"


# --- what the reference server answers -------------------------------------------------------


def _in_vocab(body: dict[str, Any], key: str, nested: str | None = None) -> dict[str, Any]:
    """The documented request with its (Qwen) token ids mapped into the reference vocabulary and
    room to end on a stop token, as the documented answers do."""
    body = json.loads(json.dumps(body))
    body[key] = [t % 2048 for t in body[key]]
    if nested:
        body[nested]["max_tokens" if "max_tokens" in body[nested] else "max_new_tokens"] = 400
    else:
        body["max_tokens"] = 400
    return body


def test_reference_server_answers_documented_requests_in_the_documented_shape() -> None:
    cases = [
        ("/inference/v1/generate", _in_vocab(fixture("vllm_generate_request"), "token_ids", "sampling_params"),
         "vllm_generate_response"),
        ("/v1/completions", _in_vocab(fixture("vllm_completions_request"), "prompt"), "vllm_completions_response"),
        ("/generate", _in_vocab(fixture("sglang_generate_request"), "input_ids", "sampling_params"),
         "sglang_generate_response"),
    ]

    async def scenario() -> list[tuple[dict[str, Any], str]]:
        answers = []
        async with policy_server() as srv, aiohttp.ClientSession(
                headers={"Authorization": f"Bearer {API_KEY}"}) as session:
            for path, body, documented in cases:
                async with session.post(srv.url + path, json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    answers.append((await resp.json(), documented))
        return answers

    for answer, documented in run(scenario()):
        assert_shape_includes(answer, fixture(documented))
        if "meta_info" in answer:
            assert answer["meta_info"]["finish_reason"]["type"] == "stop"
        else:
            assert answer["choices"][0]["finish_reason"] == "stop"


def test_shape_check_is_strict() -> None:
    documented = fixture("vllm_generate_response")
    broken = json.loads(json.dumps(documented))
    del broken["choices"][0]["logprobs"]["content"][0]["logprob"]
    with pytest.raises(AssertionError, match="logprob is missing"):
        assert_shape_includes(broken, documented)
    broken = json.loads(json.dumps(documented))
    broken["choices"][0]["token_ids"] = ["19"]
    with pytest.raises(AssertionError, match="not a number"):
        assert_shape_includes(broken, documented)
