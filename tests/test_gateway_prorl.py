"""The published rollout server's own clients against the gateway, on real HTTP, in front of a real
node daemon (local backend) and the scripted reference policy: their request building and their
parsing (tests/prorl_clients.py, each function naming the upstream path it mirrors) for completed,
failed, timed-out and cancelled jobs, 32 at once; the token ids they read are the trajectory's and
the log-probabilities the reference model's. Also their sampling_params, data sources, bodies,
authentication without code changes, and the command line."""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest
import uvloop

import prorl_clients as pc
from daemon_fixtures import node_daemon, policy_and_node
from support.net import free_port
from support.processes import ready_process
from rolloutd.daemon.gateway.auth import Access, Listen
from rolloutd.daemon.gateway.compat import prorl_answer
from rolloutd.daemon.gateway.mapping import DataSources, result_json
from rolloutd.daemon.gateway.server import STOP_WITHIN_S, serve_gateway
from rolloutd.daemon.gateway.service import GatewayConfig
from rolloutd.daemon.policy.model import default_model
from rolloutd.daemon.policy.tokenizer import load_tokenizer
from rolloutd.native_io.trajectory import Trajectory
from test_rollout_daemon import API_KEY, policy

TOKEN = "prorl-test-token"
BUDGET_MARGIN_S = 1.0
"""What a timed-out job may use past its stage budget (timeout_s): stated in the README."""
LOOPBACK = [ipaddress.ip_network("127.0.0.0/8")]


def _call(text: str) -> str:
    return f'{text}\n<tool_call>\n{json.dumps({"name": "bash", "arguments": {"command": text}})}\n</tool_call>'


SUBMIT = '<tool_call>\n{"name": "submit", "arguments": {}}\n</tool_call>'
PLANS = {"echo-1": [_call("echo hi > out.txt"), SUBMIT], "calc-1": [_call("sed -i 's/x + 1/x * 2/' calc.py"), SUBMIT],
         "slow-1": [_call("sleep 60")]}
ECHO = {"data_source": "command", "instance_id": "echo-1", "eval_script": "test \"$(cat out.txt)\" = hi && echo 1 || echo 0"}
SLOW = {"data_source": "command", "instance_id": "slow-1", "eval_script": "echo 1"}
SWE_GYM = {  # a SWE-Gym style record: test lists as JSON strings, as those datasets store them
    "data_source": "SWE-Gym", "instance_id": "calc-1", "repo": "example/calc", "version": "0.1",
    "problem_statement": "double() is wrong",
    "files": {"calc.py": "def double(x):\n    return x + 1\n", "tests/__init__.py": ""},
    "test_patch": ("--- /dev/null\n+++ b/tests/test_calc.py\n@@ -0,0 +1,4 @@\n+from calc import double\n+\n"
                   "+def test_double():\n+    assert double(4) == 8\n"),
    "FAIL_TO_PASS": json.dumps(["tests/test_calc.py::test_double"]), "PASS_TO_PASS": "[]",
}
BROKEN_SWE = {"data_source": "swebench", "instance_id": "broken-1", "problem_statement": "p",
              "workdir": "/nonexistent-testbed", "FAIL_TO_PASS": '["t.py::test_x"]'}
"""Its repository is missing from the sandbox: the init stage fails (the published server's 'init')."""


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[str, str]]:
    with policy_and_node(PLANS, API_KEY, "--backend", "local", "--workers", "1", "--warm", "4",
                         prefix="rld-prorl-") as stack:
        yield stack


@asynccontextmanager
async def gateway(address: str, *, timeout_s: float = 60.0, wait_s: float | None = None,
                  trusted: list[Any] = LOOPBACK, tokenizer: Any = None) -> AsyncIterator[tuple[str, Any]]:
    """The gateway in its default mode; callers from ``trusted`` networks (loopback unless told
    otherwise: the published clients send no token) need no token."""
    config = GatewayConfig(address=address, timeout_s=timeout_s, process_wait_s=wait_s, sources=DataSources(),
                           tokenizer=tokenizer)
    access = Access(TOKEN, trusted)
    async with serve_gateway(config, Listen("127.0.0.1", 0), access) as (url, gw):
        yield url, gw


async def _started(base: str, llm_url: str) -> None:
    # NeMo-RL's environment registers servers as http://{host:port}; test_server.py adds /v1
    assert (await pc.control(base, "/clear_llm_server"))[0] == 200
    host_port = llm_url.removeprefix("http://")
    status, body = await pc.control(base, "/add_llm_server", {"address": f"http://{host_port}"})
    assert status == 200, body
    status, body = await pc.control(base, "/start")
    assert status == 200, body


def check_tokens(raw: dict[str, Any]) -> None:
    """The ids the published clients read are the trajectory's, and the log-probabilities the
    reference model's (an independent recomputation)."""
    read = pc.nemo_rl_tokens(raw)
    ids, mask = np.array(raw["response_ids"]), np.array(raw["response_mask"])
    end = int(np.flatnonzero(mask)[-1]) + 1  # up to the last model token: trailing observations are left out
    assert read["prompt_ids"] == raw["prompt_ids"] and read["response_ids"] == ids[:end].tolist()
    assert read["assistant_masks"] == mask[:end].tolist()
    full = np.concatenate([raw["prompt_ids"], ids[:end]])
    recomputed = default_model().sequence_logprobs(full)[len(raw["prompt_ids"]):]
    model = mask[:end] == 1
    assert np.max(np.abs(recomputed[model] - np.array(read["log_probs"])[model])) <= 1e-5
    assert np.array_equal(np.array(read["log_probs"])[model], np.array(raw["response_logprobs"])[:end][model])
    offset = 0
    for message in raw["messages"]:
        if message["role"] == "assistant":
            assert message["input_ids"] == full[:offset].tolist()  # the context the server was given
        offset += len(message["token_ids"])


def assert_patch_fixes_calc(patch: str) -> None:
    """The git_patch applies to the task's files and makes the agent's change (an independent git)."""
    with tempfile.TemporaryDirectory() as folder:
        for rel, text in SWE_GYM["files"].items():
            (Path(folder) / rel).parent.mkdir(parents=True, exist_ok=True)
            (Path(folder) / rel).write_text(text)
        subprocess.run(["git", "init", "-q"], cwd=folder, check=True)
        subprocess.run(["git", "apply", "-"], cwd=folder, input=patch, text=True, check=True)
        assert (Path(folder) / "calc.py").read_text() == "def double(x):\n    return x * 2\n"


def check_not_trainable(raw: dict[str, Any], critical: str) -> None:
    assert (raw["critical_error"], raw["filter"], raw["success"], raw["resolved"]) == (critical, True, False, False), raw
    with pytest.raises(AssertionError, match="Critical error"):
        pc.published_check(raw)


async def test_completed_jobs_parse_in_each_client(stack: tuple[str, str]) -> None:
    address, llm = stack
    tokenizer = load_tokenizer()  # the node's (the reference policy's), for the messages' text
    async with gateway(address, tokenizer=tokenizer) as (base, _):
        await _started(base, llm)
        out = await pc.token_process_request(base, {**SWE_GYM, "trajectory_id": 0}, pc.TOKEN_SAMPLING_PARAMS)
        assert out is not None
        parsed, raw = out["parsed"], out["raw"]
        assert [m["role"] for m in raw["messages"]] == ["user", "assistant", "tool", "assistant"]
        assert "double() is wrong" in raw["messages"][0]["content"]
        assert raw["messages"][1]["content"].startswith(PLANS["calc-1"][0])
        assert [m["content"] for m in raw["messages"]] == [tokenizer.decode(m["token_ids"]) for m in raw["messages"]]
        assert parsed["tools"] == len(raw["tools"]) > 0 and {t["function"]["name"] for t in raw["tools"]} >= \
            {"bash", "submit"}
        pc.published_check(raw)
        assert (raw["success"], raw["resolved"], raw["filter"], raw["finish"], raw["end_properly"]) == \
            (True, True, False, True, True), raw
        assert_patch_fixes_calc(raw["git_patch"])
        assert raw["instance_id"] == "calc-1" and raw["trajectory_id"] == 0 and raw["reward"] == 1.0
        assert "api_key" in raw["notes"][0] and "custom_tokenizer" in raw["notes"][0]
        check_tokens(raw)

        # test_server.py's run: max_iterations 1 is one model turn; ending there is not the model's submit
        result = await pc.v1_process_request(base, {**ECHO, "trajectory_id": 1}, pc.V1_SAMPLING_PARAMS)
        assert result is not None and result["messages"] == 2 and result["num_turns"] == 1  # user, assistant
        assert (result["finish_reason"], result["critical_error"], result["success"], result["filter"]) == \
            ("max_turns", None, False, True), result

        data, retry = await pc.nemo_rl_send(base, {**ECHO, "trajectory_id": 2}, pc.NEMO_RL_SAMPLING_PARAMS)
        assert not retry and data is not None and data["resolved"] is True and data["git_patch"] is None
        check_tokens(data)

        # test_server.py's start_server_api form (/v1) names the same server; get_status, stop_server
        status, body = await pc.control(base, "/add_llm_server", {"address": f"{llm}/v1"})
        assert status == 200 and body["address"] == llm, body
        status, body = await pc.control(base, "/status")
        assert status == 200 and body["status"] == "running" and body["pending_jobs"] == 0 and body["llm_servers"] == [llm]
        assert (await pc.control(base, "/stop"))[0] == 200
        assert (await pc.control(base, "/status"))[0] == 503


@pytest.mark.apptainer
async def test_completed_and_failed_jobs_in_apptainer_sandboxes(short_tmp: Path) -> None:
    """As the issue's user runs it: Apptainer sandboxes; NeMo-RL's client reads a SWE-Gym job, and a
    job whose repository is missing from the image fails as their 'init'."""
    with policy(PLANS, short_tmp) as llm:
        with node_daemon(short_tmp / "n", "--backend", "apptainer", "--workers", "1", "--warm", "1",
                         env={"ROLLOUTD_INFERENCE_API_KEY": API_KEY}) as address:
            async with gateway(address) as (base, _):
                await _started(base, llm)
                (data, retry), (failed, failed_retry) = await asyncio.gather(
                    pc.nemo_rl_send(base, {**SWE_GYM, "trajectory_id": 0}, pc.NEMO_RL_SAMPLING_PARAMS),
                    pc.nemo_rl_send(base, {**BROKEN_SWE, "trajectory_id": 0}, pc.NEMO_RL_SAMPLING_PARAMS))
    assert not retry and data["resolved"] and not data["filter"], data
    assert_patch_fixes_calc(data["git_patch"])
    check_tokens(data)
    assert (failed, failed_retry) == (None, True)  # no messages: NeMo-RL retries it instead of scoring a 0


async def test_32_jobs_at_once_completed_failed_timed_out_cancelled(stack: tuple[str, str]) -> None:
    address, llm = stack
    timeout_s = 15.0  # the stage time a completed SWE job may need on two busy cores, well under it
    async with gateway(address, timeout_s=timeout_s) as (base, gw):
        await _started(base, llm)
        echo = [pc.token_process_request(base, {**ECHO, "trajectory_id": i}, pc.TOKEN_SAMPLING_PARAMS)
                for i in range(12)]
        swe = [pc.nemo_rl_send(base, m, pc.NEMO_RL_SAMPLING_PARAMS) for m in pc.nemo_rl_instances([SWE_GYM], 8)]
        failed = [pc.v1_process_request(base, {**BROKEN_SWE, "trajectory_id": i}, pc.V1_SAMPLING_PARAMS)
                  for i in range(4)]
        timed_out = [pc.token_process_request(base, {**SLOW, "trajectory_id": i}, pc.TOKEN_SAMPLING_PARAMS)
                     for i in range(4)]
        cancelled = [pc.dapo_process(base, {**SLOW, "trajectory_id": 10 + i}, pc.NEMO_RL_SAMPLING_PARAMS,
                                     f"dapo-{i}") for i in range(4)]
        jobs = [asyncio.ensure_future(c) for c in [*echo, *swe, *failed, *timed_out, *cancelled]]
        assert len(jobs) == 32
        # cancel the DAPO jobs while their `sleep 60` runs (the node has their sandboxes by then)
        deadline = time.monotonic() + 60
        while not all(f"dapo-{i}" in gw.jobs for i in range(4)) or \
                (await gw.client.status())["sandboxes"]["leased"] < 4:
            assert time.monotonic() < deadline, "the cancelled jobs never ran"
            await asyncio.sleep(0.2)
        assert all([await pc.dapo_cancel(base, f"dapo-{i}") for i in range(4)])
        results = await asyncio.wait_for(asyncio.gather(*jobs), 300)

    for out in results[:12]:
        assert out is not None
        pc.published_check(out["raw"])
        assert out["raw"]["resolved"] and not out["raw"]["filter"]
        check_tokens(out["raw"])
    for data, retry in results[12:20]:
        assert not retry and data["resolved"], (data["finish_reason"], data["timing"], data["error"])
        assert_patch_fixes_calc(data["git_patch"])
        check_tokens(data)
    for result in results[20:24]:
        # the v1 client parses it (no KeyError); its own check flags it; NeMo-RL's would retry it
        assert result is not None and result["messages"] == 0 and result["tools"] == 0
        check_not_trainable(result, "init")
        assert result["ended_by"] == "task" and "nonexistent-testbed" in result["error"]
    for out in results[24:28]:
        raw = out["raw"]
        check_not_trainable(raw, "timeout")
        assert raw["timing"]["timeout_triggered"] is True
        assert raw["timing"]["counted_elapsed"] <= timeout_s + BUDGET_MARGIN_S, raw["timing"]
        check_tokens(raw)  # the turn made before the time ran out is there, as recorded
    for status, raw in results[28:32]:
        assert status == 200 and raw["finish_reason"] == "cancelled" and raw["job_id"].startswith("dapo-"), raw
        check_not_trainable(raw, "timeout")  # the published server marks a cancel as a time-out
        parsed = pc.token_parse(raw)["parsed"]  # what rolloutd recorded of a cancelled agent: nothing
        assert parsed["messages"] == [] and raw["response_ids"] == [] and parsed["tools"] == 0
        assert pc.nemo_rl_accept(status, raw) == (None, True)  # NeMo-RL retries it: a refill, not a 0


async def test_sampling_params_and_data_sources(stack: tuple[str, str]) -> None:
    address, llm = stack
    async with gateway(address) as (base, _):
        await _started(base, llm)
        async with aiohttp.ClientSession() as session:
            async def process(instance: dict[str, Any], params: dict[str, Any]) -> tuple[int, Any]:
                async with session.post(f"{base}/process", json={"instance": instance, "sampling_params": params}) as r:
                    return r.status, await r.json()

            status, body = await process(ECHO, {**pc.TOKEN_SAMPLING_PARAMS, "frobnicate": 1})
            assert (status, body["code"]) == (400, "CONFIG") and "frobnicate" in body["detail"], body
            status, body = await process(ECHO, {"max_iterations": 3, "max_turns": 4})
            assert status == 400 and "max_turns twice" in body["detail"], body
            status, body = await process(ECHO, {"max_output_tokens": 1, "max_tokens": 2})
            assert status == 400 and "max_tokens twice" in body["detail"], body
            status, body = await process({**ECHO, "data_source": "math"}, {})
            assert status == 400 and "SWE-Gym" in body["detail"] and "bundled" in body["detail"], body
            no_source = {k: v for k, v in SWE_GYM.items() if k != "data_source"}  # theirs: swebench by default
            status, body = await process({**no_source, "FAIL_TO_PASS": "[]"}, {})
            assert status == 400 and "not a valid 'swe' task" in body["detail"] and "FAIL_TO_PASS" in body["detail"]
            status, body = await process({**SWE_GYM, "FAIL_TO_PASS": "not json"}, {})
            assert status == 400 and "FAIL_TO_PASS" in body["detail"], body


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth):
        value = {"a": value}
    return value


async def _raw_http(base: str, request: bytes, *, read_timeout_s: float) -> bytes:
    host, port = base.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(65536), read_timeout_s)
    finally:
        writer.close()


async def test_bodies_are_checked_as_their_server_checks_them(stack: tuple[str, str]) -> None:
    address, llm = stack
    async with gateway(address, wait_s=0.5) as (base, _):
        await _started(base, llm)
        async with aiohttp.ClientSession() as session:
            async def post(route: str, data: bytes) -> tuple[int, Any]:
                async with session.post(f"{base}{route}", data=data,
                                        headers={"Content-Type": "application/json"}) as r:
                    return r.status, await r.json()

            for route, data, loc in [("/process", b'{"instance": {', ["body"]),
                                     ("/process", b'[1]', ["body"]),
                                     ("/process", json.dumps({"instance": ECHO}).encode(), ["body", "sampling_params"]),
                                     ("/process", json.dumps({"instance": 3, "sampling_params": {}}).encode(),
                                      ["body", "instance"]),
                                     ("/cancel", b"{}", ["body", "job_id"]),
                                     ("/add_llm_server", b'{"address": 5}', ["body", "address"]),
                                     ("/process", b"[" * 100_000 + b"]" * 100_000, ["body"]),
                                     ("/process", json.dumps({"instance": _nested(80), "sampling_params": {}})
                                      .encode(), ["body"])]:
                status, body = await post(route, data)
                assert status == 422 and isinstance(body["detail"], list), (route, data[:40], status, body)
                assert body["detail"][0]["loc"] == loc, body
            # a job that outlives the wait: 504, its message in the wait's own unit
            async with session.post(f"{base}/process", json={"instance": SLOW, "sampling_params": {}}) as r:
                assert r.status == 504 and "within 0.5 s" in (await r.json())["detail"]
        # a huge announced body is refused at once, not waited for
        t0 = time.monotonic()
        answer = await _raw_http(base, b"POST /process HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: 1000000000000\r\n\r\n{", read_timeout_s=10)
        assert answer.startswith(b"HTTP/1.1 413") and time.monotonic() - t0 < 5, answer[:200]


async def test_token_in_the_url_or_a_trusted_network(stack: tuple[str, str]) -> None:
    address, _ = stack
    async with gateway(address, trusted=[]) as (base, _):
        status, text = await pc.control(base, "/start")
        assert status == 401 and "no token sent" in text and "http://rolloutd:<token>@" in text
        with_token = base.replace("http://", f"http://rolloutd:{TOKEN}@")
        status, body = await pc.control(with_token, "/start")  # their own code; only the URL changed
        assert status == 200, body
        status, text = await pc.control(base.replace("http://", "http://rolloutd:wrong@"), "/status")
        assert status == 401 and "does not match" in text
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{base}/status", headers={"Authorization": "Bearer wrong"}) as r:
                assert r.status == 401 and "does not match" in (await r.json())["detail"]
            basic = base64.b64encode(f"anyone:{TOKEN}".encode()).decode()
            async with session.get(f"{base}/status", headers={"Authorization": f"Basic {basic}"}) as r:
                assert r.status == 200
    async with gateway(address, trusted=[ipaddress.ip_network("10.0.0.0/8")]) as (base, _):
        assert (await pc.control(base, "/start"))[0] == 401  # loopback is not in the trusted network
    async with gateway(address) as (base, _):
        assert (await pc.control(base, "/start"))[0] == 200  # from a trusted network: no token needed


def test_command_line_binds_a_node_address_and_stops_fast(stack: tuple[str, str], short_tmp: Path) -> None:
    address, llm = stack
    token_file = short_tmp / "token"
    token_file.write_text(TOKEN + "\n")
    cmd = [sys.executable, "-m", "rolloutd.cli.main", "gateway", "--token-file", str(token_file), "--address",
           address]
    token_file.chmod(0o644)
    loose = subprocess.run([*cmd, "--bind", "127.0.0.1:0"], capture_output=True, text=True, timeout=60)
    assert loose.returncode == 2 and "chmod 600" in loose.stderr, loose.stderr
    token_file.chmod(0o600)
    for bad in ("0.0.0.0/0", "nonsense"):
        refused = subprocess.run([*cmd, "--bind", "0.0.0.0:0", "--trusted-network", bad], capture_output=True,
                                 text=True, timeout=60)
        assert refused.returncode == 2 and "--trusted-network" in refused.stderr, refused.stderr
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "ROLLOUTD_GATEWAY_TOKEN"}
    with ready_process([*cmd, "--bind", f"0.0.0.0:{port}", "--trusted-network", "127.0.0.0/8", "--timeout-s", "60",
                        "--tokenizer", "reference", "--start", "--inference-server", llm], env) as (proc, line):
        assert line == f"READY http://0.0.0.0:{port}", (line, proc.stderr.read() if proc.poll() is not None else "")
        base = f"http://127.0.0.1:{port}"

        async def in_flight_then_sigterm() -> float:
            job = asyncio.ensure_future(pc.token_process_request(base, {**SLOW, "trajectory_id": 0}, {}))
            deadline = time.monotonic() + 60
            while True:  # wait until the job is pending at the gateway
                status, body = await pc.control(base, "/status")
                if status == 200 and body["pending_jobs"] == 1:
                    break
                assert time.monotonic() < deadline and not job.done(), "the job never became pending"
                await asyncio.sleep(0.1)
            # a hung node (its supervisor frozen) must not hold the gateway's stop
            node_pid = int((Path(address.removeprefix("ipc://")).parent / "node.pid").read_text())
            os.kill(node_pid, signal.SIGSTOP)
            try:
                t0 = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                assert await job is None  # answered (503), not left hanging
                await asyncio.to_thread(proc.wait, 120)
                return time.monotonic() - t0
            finally:
                os.kill(node_pid, signal.SIGCONT)

        took = uvloop.run(in_flight_then_sigterm())
        assert proc.returncode == 0 and took < STOP_WITHIN_S + 2, (took, proc.stderr.read())


@pytest.mark.parametrize(("finish", "ended_by", "last_stage", "critical", "success"), [
    ("completed", "model", "eval", None, True),
    ("max_turns", "model", "eval", None, False),
    ("timeout", "deadline", "run", "timeout", False),
    ("timeout", "sandbox", "init", "timeout", False),
    ("cancelled", "client", "run", "timeout", False),
    ("error", "sandbox", "run", "run", False),
    ("error", "inference", "run", "run", False),
    ("error", "daemon", "eval", "eval", False),
    ("error", "task", "init", "init", False),
])
def test_every_ending_maps_to_their_critical_error_and_filter(finish: str, ended_by: str, last_stage: str,
                                                              critical: str | None, success: bool) -> None:
    """Infrastructure endings (sandbox, inference, daemon) and time-outs are never a trainable 0."""
    arrays = {"prompt_ids": np.array([1, 2], np.int32), "response_ids": np.array([3, 4, 5], np.int32),
              "response_mask": np.array([1, 1, 0], np.uint8), "response_logprobs": np.array([-.5, -.25, 0], np.float32)}
    t = Trajectory(request_id="r", sample_index=0, task_id="t", reward=0.0, finish_reason=finish, num_turns=1,
                   ended_by=ended_by, metrics={"stage_events": [("init", "enter", 0.0), (last_stage, "enter", 1.0)]},
                   error_message="boom" if finish == "error" else None, **arrays)
    answer = prorl_answer(result_json(t, job_id="j", instance={}, wall_s=1.0), t, [])
    assert (answer["critical_error"], answer["success"], answer["filter"]) == (critical, success, not success)
    assert answer["resolved"] is False and answer["reward"] == 0.0
    assert [m["token_ids"] for m in answer["messages"]] == [[1, 2], [3, 4]]  # the trailing observation is left out
