"""The reference CPU policy: tokenizer assets, model, sampler, and the server over real HTTP."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
from inference_support import API_KEY, PROMPT, max_logprob_error, policy_server, wait_until
from support.loop import run

from rolloutd.daemon.inference.base import SamplingParams
from rolloutd.daemon.inference.sglang_http import SGLangHTTPBackend
from rolloutd.daemon.inference.vllm_http import VLLMHTTPBackend
from rolloutd.daemon.policy import train_tokenizer
from rolloutd.daemon.policy.model import ModelConfig, ReferenceModel, default_model
from rolloutd.daemon.policy.sampling import sample_batch
from rolloutd.daemon.policy.scripted import PAST_END_REPLY, ScriptedPlans
from rolloutd.daemon.policy.server import PolicyServerConfig, build_app
from rolloutd.daemon.policy.tokenizer import (
    DEFAULT_TOKENIZER_DIR,
    SPECIAL_TOKENS,
    STRIP_THINK_TEMPLATE_PATH,
    load_tokenizer,
)
from rolloutd.native_io.errors import ConfigError

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "Run a shell command.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Task id: demo-1\nMake the tests pass."},
    {"role": "assistant", "content": "<think>\nRun them first.\n</think>\nRunning the tests.",
     "tool_calls": [{"type": "function", "function": {"name": "bash", "arguments": {"command": "pytest -q"}}}]},
    {"role": "tool", "content": "1 failed"},
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "bash", "arguments": '{"command": "cat a.py"}'}}]},
    {"role": "tool", "content": "x = 1"},
    {"role": "user", "content": "Any progress?"},
    {"role": "assistant", "content": "<think>\nAlmost.\n</think>\nYes."},
]


# --- tokenizer -------------------------------------------------------------------------------


def test_tokenizer_loads_like_a_hub_model() -> None:
    tok = load_tokenizer()
    assert len(tok) == 2048
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    ids = [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    assert ids == list(range(len(SPECIAL_TOKENS)))  # trained first, so the model's ids stay fixed
    text = "<|im_start|>user\nRun `python -m pytest -q` please<|im_end|>\n<tool_call>\n{}\n</tool_call>"
    enc = tok.encode(text, add_special_tokens=False)
    assert tok.decode(enc) == text
    assert enc[0] == 1 and enc.count(3) == 1  # specials are single tokens, never split
    assert len(enc) < len(text) / 2  # the BPE actually merges


def test_chat_template_renders_tools_tool_calls_and_tool_responses() -> None:
    tok = load_tokenizer()
    text = tok.apply_chat_template(CONVERSATION[:4], tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a coding agent.\n\n# Tools\n\nYou can call the functions described below. "
        "Each description is a JSON object.\n<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>\n\n"
        "To call a function, write a JSON object with its name and arguments between <tool_call> and "
        "</tool_call> tags:\n<tool_call>\n{\"name\": \"function name\", \"arguments\": {\"argument\": \"value\"}}\n"
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\nTask id: demo-1\nMake the tests pass.<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nRun them first.\n</think>\nRunning the tests.\n<tool_call>\n"
        "{\"name\": \"bash\", \"arguments\": {\"command\": \"pytest -q\"}}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n1 failed\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    second = tok.apply_chat_template(CONVERSATION[4:5], tokenize=False)
    assert second == ("<|im_start|>assistant\n<tool_call>\n{\"name\": \"bash\", \"arguments\": "
                      "{\"command\": \"cat a.py\"}}\n</tool_call><|im_end|>\n")


def _is_append_only(tok: Any, template: str | None) -> bool:
    for cut in range(1, len(CONVERSATION)):
        short = tok.apply_chat_template(CONVERSATION[:cut], chat_template=template, tokenize=False)
        full = tok.apply_chat_template(CONVERSATION, chat_template=template, tokenize=False)
        if not full.startswith(short):
            return False
    return True


def test_default_template_is_append_only_and_strip_think_is_not() -> None:
    tok = load_tokenizer()
    assert _is_append_only(tok, None)
    strip = STRIP_THINK_TEMPLATE_PATH.read_text()
    assert not _is_append_only(tok, strip)
    rendered = tok.apply_chat_template(CONVERSATION, chat_template=strip, tokenize=False)
    assert "Run them first" not in rendered and "Almost." in rendered  # only earlier turns lose their thinking


def test_shipped_tokenizer_is_what_the_script_trains(tmp_path: Path) -> None:
    config = json.loads((DEFAULT_TOKENIZER_DIR / "tokenizer_config.json").read_text())
    assert config["chat_template"] == train_tokenizer.DEFAULT_TEMPLATE_PATH.read_text()
    assert train_tokenizer.main(["--out", str(tmp_path)]) == 0
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / name).read_bytes() == (DEFAULT_TOKENIZER_DIR / name).read_bytes(), name


# --- model and sampler -----------------------------------------------------------------------


def test_model_logprob_views_agree_and_weights_round_trip(tmp_path: Path) -> None:
    model = default_model()
    rng = np.random.default_rng(0)
    prompt, response = rng.integers(0, 2048, 17), rng.integers(0, 2048, 9)
    seq = model.sequence_logprobs(np.concatenate([prompt, response]))
    tok = model.token_logprobs(prompt, response)
    np.testing.assert_array_equal(seq[len(prompt):], tok)
    assert seq[0] == 0.0 and seq.dtype == np.float32 and (seq[1:] < 0).all()
    # A row of a batch equals the same context computed alone.
    ctx = model.contexts(prompt)
    np.testing.assert_allclose(model.next_logprobs(ctx)[5], model.next_logprobs(ctx[5:6])[0], atol=1e-12)
    path = tmp_path / "w.npz"
    other = ReferenceModel.init(seed=5)
    other.save(path)
    loaded = ReferenceModel.load(path)
    np.testing.assert_array_equal(loaded.token_logprobs(prompt, response), other.token_logprobs(prompt, response))
    assert not np.array_equal(other.token_logprobs(prompt, response), tok)
    ReferenceModel.init(config=ModelConfig(hidden=8)).save(path)
    with pytest.raises(ConfigError, match="hidden"):
        ReferenceModel(loaded.params, ModelConfig(hidden=8))
    with pytest.raises(ConfigError, match="cannot load"):
        ReferenceModel.load(tmp_path / "missing.npz")


def test_sampler_follows_the_model_distribution() -> None:
    model = default_model()
    logits = model.logits(model.contexts(PROMPT)[-1:])
    lp = model.next_logprobs(model.contexts(PROMPT)[-1:])[0]
    n = 4000
    batch = np.repeat(logits, n, axis=0)
    params = [SamplingParams(max_tokens=1)] * n
    tokens, logprobs = sample_batch(batch, params, [np.random.default_rng(i) for i in range(n)], [None] * n)
    np.testing.assert_allclose(logprobs, lp[tokens], atol=1e-12)  # raw log-probabilities
    for token in np.argsort(-lp)[:3]:
        p = np.exp(lp[token])
        freq = (tokens == token).mean()
        assert abs(freq - p) < 5 * np.sqrt(p * (1 - p) / n), (token, freq, p)
    greedy = int(np.argmax(lp))
    for narrow in (SamplingParams(max_tokens=1, temperature=0.0), SamplingParams(max_tokens=1, top_k=1),
                   SamplingParams(max_tokens=1, top_p=1e-6), SamplingParams(max_tokens=1, temperature=0.5, top_k=1)):
        tok, tlp = sample_batch(logits, [narrow], [np.random.default_rng(1)], [None])
        assert tok[0] == greedy and tlp[0] == pytest.approx(lp[greedy])
    top5 = set(np.argsort(-lp)[:5].tolist())
    hot_top5 = [SamplingParams(max_tokens=1, top_k=5, temperature=2.0)] * 300
    tokens, _ = sample_batch(np.repeat(logits, 300, axis=0), hot_top5, [np.random.default_rng(i) for i in range(300)],
                             [None] * 300)
    assert set(tokens.tolist()) <= top5 and len(set(tokens.tolist())) > 1


# --- the server over HTTP --------------------------------------------------------------------


async def _post(session: aiohttp.ClientSession, url: str, body: dict[str, Any] | None = None,
                headers: dict[str, str] | None = AUTH) -> tuple[int, Any]:
    async with session.post(url, json=body, headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


async def _get(session: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = AUTH) -> tuple[int, Any]:
    async with session.get(url, headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


def test_every_route_but_health_needs_the_api_key() -> None:
    app, _ = build_app(PolicyServerConfig(api_key=API_KEY))
    routes = sorted({(r.method, r.resource.canonical) for r in app.router.routes() if r.method != "HEAD"})
    assert {p for _, p in routes} >= {"/inference/v1/generate", "/v1/completions", "/generate", "/pause",
                                      "/pause_generation", "/update_weights_from_disk", "/rolloutd/utilisation"}

    async def scenario() -> None:
        async with policy_server() as srv, aiohttp.ClientSession() as session:
            for method, path in routes:
                for headers in ({}, {"Authorization": "Bearer wrong"}):
                    async with session.request(method, srv.url + path, json={}, headers=headers) as resp:
                        assert resp.status == (200 if path == "/health" else 401), (method, path)
    run(scenario())


def test_bad_requests_get_400_with_a_reason() -> None:
    async def scenario() -> None:
        async with policy_server() as srv, aiohttp.ClientSession() as session:
            gen = srv.url + "/inference/v1/generate"
            cases = [
                ({"token_ids": [], "sampling_params": {"max_tokens": 4}}, "at least one token"),
                ({"token_ids": [1, 99999], "sampling_params": {"max_tokens": 4}}, "lie in"),
                ({"token_ids": [1], "sampling_params": {"max_tokens": 0}}, "max_tokens"),
                ({"token_ids": [1], "sampling_params": {"max_tokens": 4, "logprobs": 21}}, "from 0 to 20"),
                ({"token_ids": [1], "sampling_params": {"max_tokens": 40000}}, "context"),
                ({"token_ids": [1], "stream": True}, "stream"),
            ]
            for body, reason in cases:
                status, answer = await _post(session, gen, body)
                assert status == 400 and reason in answer["message"], (body, answer)
            async with session.post(gen, data=b"{not json", headers=AUTH) as resp:
                assert resp.status == 400 and "JSON" in (await resp.json())["message"]
    run(scenario())


def test_server_process_prints_ready_and_stops_on_sigterm() -> None:
    env = {**os.environ, "ROLLOUTD_POLICY_API_KEY": API_KEY}
    proc = subprocess.Popen([sys.executable, "-m", "rolloutd.daemon.policy.server", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        assert line.startswith("READY http://127.0.0.1:"), line
        url = line.split()[1]

        async def probe() -> None:
            async with aiohttp.ClientSession() as session:
                status, models = await _get(session, url + "/v1/models")
                assert status == 200 and models["data"][0]["id"] == "rolloutd-reference"
                assert models["data"][0]["rolloutd"]["scripted"] is False
        run(probe())
        proc.terminate()
        out, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
        assert out == ""  # READY was the only line
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    no_key = subprocess.run([sys.executable, "-m", "rolloutd.daemon.policy.server"], capture_output=True, text=True,
                            env={k: v for k, v in os.environ.items() if k != "ROLLOUTD_POLICY_API_KEY"}, timeout=60)
    assert no_key.returncode == 2 and "ROLLOUTD_POLICY_API_KEY" in no_key.stderr and no_key.stdout == ""


def test_generate_reports_the_models_top_logprobs() -> None:
    """Through the vLLM backend: at every position the k most likely tokens and their
    log-probabilities, recomputed from the model's full next-token distribution."""
    async def scenario() -> Any:
        async with policy_server() as srv:
            backend = VLLMHTTPBackend(srv.url, api_key=API_KEY)
            try:
                return await backend.generate(PROMPT, SamplingParams(max_tokens=12, seed=5, top_logprobs=3),
                                              request_id="top", timeout_s=30)
            finally:
                await backend.close()
    result = run(scenario())
    assert result.top_ids is not None and result.top_logprobs is not None
    assert result.top_ids.shape == result.top_logprobs.shape == (len(result.token_ids), 3)
    model = default_model()
    full = [*PROMPT, *result.token_ids.tolist()]
    expected = model.next_logprobs(model.contexts(full)[len(PROMPT):len(full)])
    for i, row in enumerate(expected):
        order = np.argsort(-row, kind="stable")[:3]
        assert result.top_ids[i].tolist() == order.tolist()
        assert np.allclose(result.top_logprobs[i], row[order], atol=1e-5)
        assert result.top_logprobs[i][0] >= result.logprobs[i] - 1e-6  # the best is at least the sampled one


def test_pause_keep_freezes_and_resume_continues() -> None:
    async def scenario() -> None:
        async with policy_server(ms_per_token=5) as srv, aiohttp.ClientSession() as session:
            backend = VLLMHTTPBackend(srv.url, api_key=API_KEY)
            params = SamplingParams(max_tokens=60, seed=3, ignore_eos=True)
            call = asyncio.create_task(backend.generate(PROMPT, params, request_id="frozen", timeout_s=30))
            await wait_until(lambda: srv.engine.steps >= 3)
            assert (await _post(session, srv.url + "/pause?mode=keep"))[1] == {"status": "paused"}
            assert (await _get(session, srv.url + "/is_paused"))[1] == {"is_paused": True}
            frozen_at = srv.engine.steps
            await asyncio.sleep(0.2)
            assert srv.engine.steps == frozen_at and not call.done() and srv.engine.running == 1
            await _post(session, srv.url + "/resume")
            result = await call
            await backend.close()
        assert (result.finish_reason, len(result.token_ids)) == ("length", 60)
        assert max_logprob_error(PROMPT, result) <= 1e-5
    run(scenario())


def test_pause_abort_and_abort_requests_end_requests_with_abort() -> None:
    async def scenario() -> None:
        async with policy_server(ms_per_token=5) as srv, aiohttp.ClientSession() as session:
            backend = SGLangHTTPBackend(srv.url, api_key=API_KEY)
            params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
            long_prompt = [1, 5, 6, 7, 8, 9]
            first = asyncio.create_task(backend.generate(long_prompt, params, request_id="one", timeout_s=30))
            await wait_until(lambda: srv.engine.steps >= 2)
            status, answer = await _post(session, srv.url + "/abort_request", {"rid": "one"})
            assert status == 200 and answer["success"]
            aborted = await first
            second = asyncio.create_task(backend.generate(long_prompt, params, request_id="two", timeout_s=30))
            await wait_until(lambda: srv.engine.running == 1)
            assert (await _post(session, srv.url + "/pause_generation", {"mode": "abort"}))[0] == 200
            paused_abort = await second
            await _post(session, srv.url + "/continue_generation", {})
            await backend.close()
        for result in (aborted, paused_abort):
            assert result.finish_reason == "abort" and 1 <= len(result.token_ids) < 500
            assert max_logprob_error(long_prompt, result) <= 1e-5
    run(scenario())


def test_pause_wait_lets_running_requests_finish() -> None:
    async def scenario() -> None:
        async with policy_server(ms_per_token=5) as srv, aiohttp.ClientSession() as session:
            backend = VLLMHTTPBackend(srv.url, api_key=API_KEY)
            call = asyncio.create_task(backend.generate(PROMPT, SamplingParams(max_tokens=20, ignore_eos=True),
                                                        request_id="w", timeout_s=30))
            await wait_until(lambda: srv.engine.running == 1)
            await _post(session, srv.url + "/pause?mode=wait")
            assert call.done() and srv.engine.is_paused
            assert (call.result().finish_reason, len(call.result().token_ids)) == ("length", 20)
            await _post(session, srv.url + "/resume")
            await backend.close()
    run(scenario())


def test_weights_and_weight_version_updates(tmp_path: Path) -> None:
    new = ReferenceModel.init(seed=9)
    new.save(tmp_path / "weights.npz")

    async def scenario() -> None:
        async with policy_server() as srv, aiohttp.ClientSession() as session:
            backend = SGLangHTTPBackend(srv.url, api_key=API_KEY)
            before = await backend.generate(PROMPT, SamplingParams(max_tokens=8, seed=2), request_id="a", timeout_s=10)
            status, answer = await _post(session, srv.url + "/update_weights_from_disk",
                                         {"model_path": str(tmp_path), "weight_version": "step-1"})
            assert status == 200 and answer["success"], answer
            after = await backend.generate(PROMPT, SamplingParams(max_tokens=8, seed=2), request_id="b", timeout_s=10)
            status, answer = await _post(session, srv.url + "/update_weights_from_disk",
                                         {"model_path": str(tmp_path / "nope.npz")})
            assert status == 400 and not answer["success"] and "cannot load" in answer["message"]
            await _post(session, srv.url + "/update_weight_version", {"new_version": "step-2"})
            info = (await _get(session, srv.url + "/get_model_info"))[1]
            await backend.close()
        assert before.weight_version == "0" and after.weight_version == "step-1"
        assert info["weight_version"] == "step-2"
        recomputed = new.token_logprobs(PROMPT, after.token_ids)
        assert np.abs(recomputed - after.logprobs).max() <= 1e-5
        assert max_logprob_error(PROMPT, after) > 1e-3  # the old weights would disagree
    run(scenario())


def test_slot_simulation_queues_and_reports_utilisation() -> None:
    async def scenario() -> None:
        async with policy_server(slots=2, ms_per_token=4) as srv, aiohttp.ClientSession() as session:
            backend = VLLMHTTPBackend(srv.url, api_key=API_KEY)
            await _post(session, srv.url + "/rolloutd/utilisation/reset")
            params = SamplingParams(max_tokens=15, ignore_eos=True)
            peak = {"running": 0, "waiting": 0}

            async def watch() -> None:
                while True:
                    peak["running"] = max(peak["running"], srv.engine.running)
                    peak["waiting"] = max(peak["waiting"], srv.engine.waiting)
                    await asyncio.sleep(0.002)
            watcher = asyncio.create_task(watch())
            results = await asyncio.gather(*(backend.generate([1, 9 + i], params, request_id=f"s{i}", timeout_s=30)
                                             for i in range(4)))
            watcher.cancel()
            busy = (await _get(session, srv.url + "/rolloutd/utilisation"))[1]
            await asyncio.sleep(0.3)
            idle = (await _get(session, srv.url + "/rolloutd/utilisation"))[1]
            await backend.close()
        # Two slots for four requests: two run at a time and at least two wait (all four may wait
        # for a moment when they arrive before the engine's next step admits any).
        assert peak["running"] == 2 and 2 <= peak["waiting"] <= 4
        assert all(len(r.token_ids) == len(r.logprobs) for r in results)
        assert 0.0 < busy["utilisation"] <= 1.0 and busy["window_s"] > 0
        assert idle["window_s"] > busy["window_s"] and idle["utilisation"] < busy["utilisation"]
    run(scenario())


def test_scripted_mode_follows_plans_with_true_logprobs(caplog: pytest.LogCaptureFixture) -> None:
    tok = load_tokenizer()
    reply_1 = 'Running the tests.\n<tool_call>\n{"name": "bash", "arguments": {"command": "pytest -q"}}\n</tool_call>'
    plans = ScriptedPlans({"demo-1": [reply_1, "All tests pass."]})
    system = {"role": "system", "content": "You are a coding agent."}
    user = {"role": "user", "content": "Task id: demo-1\nMake the tests pass."}

    def prompt(messages: list[dict[str, str]]) -> list[int]:
        return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False)

    async def scenario() -> None:
        caplog.set_level(logging.WARNING, logger="rolloutd.daemon.policy.server")
        async with policy_server(scripted=plans) as srv, aiohttp.ClientSession() as session:
            backend = VLLMHTTPBackend(srv.url, api_key=API_KEY)
            params = SamplingParams(max_tokens=200, seed=1)
            p1 = prompt([system, user])
            turn1 = await backend.generate(p1, params, request_id="t1", timeout_s=10)
            p2 = p1 + turn1.token_ids.tolist() + tok.encode(
                "\n<|im_start|>user\n<tool_response>\n3 passed\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
                add_special_tokens=False)
            turn2 = await backend.generate(p2, params, request_id="t2", timeout_s=10)
            p3 = p2 + turn2.token_ids.tolist() + tok.encode(
                "\n<|im_start|>user\nMore?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
            turn3 = await backend.generate(p3, params, request_id="t3", timeout_s=10)
            cut = await backend.generate(p1, SamplingParams(max_tokens=3), request_id="t4", timeout_s=10)
            unplanned = prompt([system, {"role": "user", "content": "Task id: other\nHello"}])
            free = await backend.generate(unplanned, params, request_id="t5", timeout_s=10)
            models = (await _get(session, srv.url + "/v1/models"))[1]["data"][0]
            info = (await _get(session, srv.url + "/get_model_info"))[1]
            await backend.close()
        for p, r, text in ((p1, turn1, reply_1), (p2, turn2, "All tests pass."), (p3, turn3, PAST_END_REPLY)):
            assert r.finish_reason == "stop"
            assert tok.decode(r.token_ids.tolist()) == text + "<|im_end|>"
            assert max_logprob_error(p, r) <= 1e-5
        assert (len(cut.token_ids), cut.finish_reason) == (3, "length")
        assert tok.decode(cut.token_ids.tolist()) == tok.decode(turn1.token_ids[:3].tolist())
        assert max_logprob_error(unplanned, free) <= 1e-5
        assert "All tests pass" not in tok.decode(free.token_ids.tolist())
        assert models["id"] == "rolloutd-reference-scripted" and models["rolloutd"]["scripted"] is True
        assert info["scripted"] is True
        assert any("SCRIPTED" in rec.getMessage() for rec in caplog.records)
    run(scenario())


def test_scripted_plans_file_is_validated(tmp_path: Path) -> None:
    good = tmp_path / "plans.json"
    good.write_text(json.dumps({"plans": {"a": ["x", "y"]}}))
    assert ScriptedPlans.load(good).reply_for("Task id: a\n<|im_start|>assistant\n") == "x"
    assert ScriptedPlans.load(good).reply_for("Task id: ab\n<|im_start|>assistant\n") is None
    bad = tmp_path / "bad.json"
    for content in ('{"plans": {"a": "x"}}', '{"a": ["x"]}', "not json"):
        bad.write_text(content)
        with pytest.raises(ConfigError, match="plans"):
            ScriptedPlans.load(bad)
