"""The HTTP gateway over real HTTP, in front of a real node daemon (local backend) and the scripted
reference policy: the published server's routes and statuses, bearer tokens, data sources,
time-outs, cancel and stop, and the command line (loopback refusal, READY, SIGTERM)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import psutil
import pytest
import uvloop

from daemon_fixtures import policy_and_node
from support.processes import ready_process
from support.waits import async_poll, async_wait_until
from rolloutd.daemon.gateway.auth import Access, Listen
from rolloutd.daemon.gateway.mapping import DataSources
from rolloutd.daemon.gateway.server import serve_gateway
from rolloutd.daemon.gateway.service import GatewayConfig
from rolloutd.daemon.node.config import NodeConfig
from rolloutd.daemon.node.sandbox_user import workers_dir
from rolloutd.daemon.policy.model import default_model
from rolloutd.daemon.tasks.datasets import oracle_plans
from test_rollout_daemon import API_KEY

TOKEN = "gateway-test-token"
ROUTES = [("POST", "/start"), ("POST", "/stop"), ("GET", "/status"), ("POST", "/add_llm_server"),
          ("POST", "/clear_llm_server"), ("POST", "/process"), ("POST", "/cancel")]


def _call(text: str) -> str:
    return f'{text}\n<tool_call>\n{json.dumps({"name": "bash", "arguments": {"command": text}})}\n</tool_call>'


GATEWAY_WAIT_S = 10.0
"""A job shows in /status, and the node reports a stage or goes idle, well within this."""
SUBMIT = '<tool_call>\n{"name": "submit", "arguments": {}}\n</tool_call>'
PLANS = {"wordwrap-001": oracle_plans()["wordwrap-001"], "slow-1": [_call("sleep 30")],
         "echo-1": [_call("echo hi > out.txt"), SUBMIT]}
SLOW = {"data_source": "command", "instance_id": "slow-1", "eval_script": "echo 1", "trajectory_id": 0}
ECHO = {"data_source": "command", "instance_id": "echo-1", "trajectory_id": 3,
        "eval_script": "test \"$(cat out.txt)\" = hi && echo 1 || echo 0"}


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[str, str]]:
    """(node address, policy URL): one scripted policy and one node daemon for the module; the
    node starts with no inference server (the gateway adds it)."""
    with policy_and_node(PLANS, API_KEY, "--backend", "local", "--workers", "1", "--warm", "2",
                         prefix="rld-gw-") as stack:
        yield stack


@asynccontextmanager
async def gateway(address: str, *, timeout_s: float = 60.0, wait_s: float | None = None,
                  prorl: bool = True) -> AsyncIterator[Any]:
    config = GatewayConfig(address=address, timeout_s=timeout_s, process_wait_s=wait_s, sources=DataSources(),
                           prorl=prorl)
    async with serve_gateway(config, Listen("127.0.0.1", 0), Access(TOKEN)) as (url, gw):
        async with aiohttp.ClientSession(url) as session:
            yield Http(session), gw


class Http:
    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session

    async def __call__(self, method: str, path: str, body: Any = None, *, token: str | None = TOKEN,
                       raw: bytes | None = None) -> tuple[int, dict[str, Any]]:
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        kwargs: dict[str, Any] = {"data": raw, "headers": {**headers, "Content-Type": "application/json"}} \
            if raw is not None else {"json": body, "headers": headers}
        async with self.session.request(method, path, **kwargs) as resp:
            return resp.status, await resp.json()


async def test_token_required_on_every_route_and_lifecycle_statuses(stack: tuple[str, str]) -> None:
    address, _ = stack
    async with gateway(address) as (http, gw):
        for method, path in ROUTES:
            for token in (None, "wrong"):
                status, body = await http(method, path, {}, token=token)
                assert (status, body["code"]) == (401, "UNAUTHORIZED"), (method, path, token)
        assert not gw.running  # nothing ran without the token
        for method, path in [("POST", "/process"), ("GET", "/status"), ("POST", "/cancel"), ("POST", "/stop")]:
            status, body = await http(method, path, {"job_id": "x"})
            assert (status, body["code"]) == (503, "NOT_RUNNING"), path
        assert (await http("POST", "/start"))[0] == 200
        status, body = await http("POST", "/start")
        assert status == 400 and "already running" in body["detail"]
        status, body = await http("GET", "/status")
        assert status == 200 and body["status"] == "running" and body["pending_jobs"] == 0
        assert body["node"]["workers"], body
        assert (await http("POST", "/stop"))[0] == 200
        assert (await http("POST", "/stop"))[0] == 503


async def test_start_without_a_node_daemon_is_503(short_tmp: Path) -> None:
    async with gateway(f"ipc://{short_tmp}/no-node.sock") as (http, gw):
        status, body = await http("POST", "/start")
        assert (status, body["code"]) == (503, "DAEMON_UNAVAILABLE") and "rolloutd node start" in body["detail"], body
        assert not gw.running


async def test_process_a_bundled_task_and_an_inline_one(stack: tuple[str, str]) -> None:
    address, url = stack
    async with gateway(address) as (http, gw):
        status, body = await http("POST", "/add_llm_server", {"address": url.removeprefix("http://") + "/v1"})
        assert (status, body["address"]) == (200, url), body  # host:port/v1 taken as the server's root
        assert (await http("POST", "/start"))[1]["llm_servers"] == [url]
        instance = {"data_source": "bundled", "instance_id": "wordwrap-001", "trajectory_id": 1}
        status, r = await http("POST", "/process", {"instance": instance, "job_id": "job-a",
                                                    "sampling_params": {"temperature": 1.0, "max_tokens": 1024,
                                                                        "max_turns": 8}})
        assert status == 200, r
        assert (r["job_id"], r["instance_id"], r["trajectory_id"]) == ("job-a", "wordwrap-001", 1)
        assert (r["finish_reason"], r["reward"], r["resolved"], r["finish"], r["error"]) == \
            ("completed", 1.0, True, True, None)
        timing = r["timing"]
        assert timing["counted_elapsed"] == pytest.approx(timing["init_time"] + timing["run_time"] + timing["eval_time"])
        assert timing["run_time"] > 0 and timing["eval_time"] > 0 and timing["others_time"] >= 0
        assert timing["timeout_triggered"] is False
        ids, mask, lps = (np.array(r[k]) for k in ("response_ids", "response_mask", "response_logprobs"))
        assert len(ids) == len(mask) == len(lps) > 0 and set(r["weight_versions"]) == {"0"}
        # Token-in/token-out survives JSON: the served log-probabilities are the model's.
        full = np.concatenate([r["prompt_ids"], ids])
        recomputed = default_model().sequence_logprobs(full)[len(r["prompt_ids"]):]
        assert np.max(np.abs(recomputed[mask == 1] - lps[mask == 1])) <= 1e-5

        status, r = await http("POST", "/process", {"instance": ECHO, "sampling_params": {}})
        assert status == 200 and (r["reward"], r["trajectory_id"], r["num_turns"]) == (1.0, 3, 2), r
        assert len(r["job_id"]) == 32  # generated when the caller gives none

        status, body = await http("POST", "/clear_llm_server")
        assert status == 200 and gw.added == {} and gw.buffered == []


async def test_bad_requests_are_400(stack: tuple[str, str]) -> None:
    address, url = stack
    async with gateway(address, prorl=False) as (http, _):
        await http("POST", "/add_llm_server", {"address": url})
        await http("POST", "/start")
        status, body = await http("POST", "/process", raw=b'{"instance": {"data_source": ')
        assert (status, body["code"]) == (400, "INVALID_BODY") and "JSON decode error" in body["detail"]
        assert (await http("POST", "/process", raw=b"[1, 2]"))[0] == 400
        status, body = await http("POST", "/process", {"instance": {"data_source": "no-such-source", "instance_id": "x"},
                                                       "sampling_params": {}})
        assert status == 400 and "unknown data_source 'no-such-source'" in body["detail"], body
        status, body = await http("POST", "/process", {"instance": {"data_source": "bundled", "instance_id": "nope"},
                                                       "sampling_params": {}})
        assert (status, body["code"]) == (400, "TASK") and "nope" in body["detail"], body
        status, body = await http("POST", "/process", {"instance": {"data_source": "command", "instance_id": "c"},
                                                       "sampling_params": {}})
        assert status == 400 and "eval_script" in body["detail"], body
        status, body = await http("POST", "/process", {"instance": ECHO, "sampling_params": {"top_p": 0}})
        assert status == 400 and "top_p" in body["detail"], body
        status, body = await http("POST", "/process", {"instance": ECHO, "sampling_params": {"max_turnz": 3}})
        assert (status, body["code"]) == (400, "CONFIG") and "max_turnz" in body["detail"], body
        assert (await http("POST", "/add_llm_server", {"address": 5}))[0] == 400
        assert (await http("POST", "/cancel", {"job": "x"}))[0] == 400


async def test_no_inference_server_is_503(stack: tuple[str, str]) -> None:
    address, _ = stack
    async with gateway(address) as (http, _):
        await http("POST", "/start")
        status, body = await http("POST", "/process", {"instance": ECHO, "sampling_params": {}})
        assert (status, body["code"]) == (503, "NO_INFERENCE_SERVER"), body


async def _wait_pending(http: Http, job_id: str) -> None:
    await async_poll(lambda: http("GET", "/status"), lambda answer: job_id in answer[1].get("jobs", {}),
                     GATEWAY_WAIT_S, f"job {job_id} listed in /status")


async def _node_idle(gw: Any) -> None:
    """Until the node holds no request and no leased sandbox any more (it reports once a second)."""
    await async_poll(gw.client.status, lambda st: st["in_flight"] == 0 and st["sandboxes"]["leased"] == 0,
                     GATEWAY_WAIT_S, "the node idle: the timed-out job no longer runs there")


async def test_time_out_is_504_and_cancels_the_job(stack: tuple[str, str]) -> None:
    address, url = stack
    async with gateway(address, wait_s=3.0) as (http, gw):
        await http("POST", "/add_llm_server", {"address": url})
        await http("POST", "/start")
        status, body = await http("POST", "/process", {"instance": SLOW, "sampling_params": {}, "job_id": "slow"})
        assert (status, body["code"]) == (504, "TIMEOUT") and "cancelled" in body["detail"], body
        assert (await http("GET", "/status"))[1]["pending_jobs"] == 0
        await _node_idle(gw)


async def test_stage_time_limit_is_a_result_with_timeout_triggered(stack: tuple[str, str]) -> None:
    address, url = stack
    async with gateway(address, timeout_s=2.0) as (http, _):
        await http("POST", "/add_llm_server", {"address": url})
        await http("POST", "/start")
        status, r = await http("POST", "/process", {"instance": SLOW, "sampling_params": {}})
        assert status == 200 and r["finish_reason"] == "timeout" and r["timing"]["timeout_triggered"] is True, r
        assert r["timing"]["counted_elapsed"] < 15


async def test_cancel_and_stop_end_pending_jobs(stack: tuple[str, str]) -> None:
    address, url = stack
    async with gateway(address) as (http, gw):
        await http("POST", "/add_llm_server", {"address": url})
        await http("POST", "/start")
        job = asyncio.ensure_future(http("POST", "/process", {"instance": SLOW, "sampling_params": {}, "job_id": "c1"}))
        await _wait_pending(http, "c1")
        # Cancel it in its run stage: once the agent's `sleep 30` runs in one of the node's sandboxes.
        sandboxes = str(workers_dir(NodeConfig(run_dir=str(Path(address.removeprefix("ipc://")).parent))))
        await async_wait_until(lambda: any(
            p.info["cmdline"] == ["sleep", "30"] and (p.info["cwd"] or "").startswith(sandboxes)
            for p in psutil.process_iter(["cmdline", "cwd"])), GATEWAY_WAIT_S, "the agent's command running",
            poll_s=0.05)
        assert (await http("POST", "/cancel", {"job_id": "no-such-job"}))[1]["pending"] is False
        status, ack = await http("POST", "/cancel", {"job_id": "c1"})
        assert status == 200 and ack["pending"] is True
        status, r = await asyncio.wait_for(job, 10)
        assert status == 200 and r["finish_reason"] == "cancelled" and r["timing"]["run_time"] > 0, r

        job = asyncio.ensure_future(http("POST", "/process", {"instance": SLOW, "sampling_params": {}, "job_id": "c2"}))
        await _wait_pending(http, "c2")
        status, body = await http("POST", "/process", {"instance": SLOW, "sampling_params": {}, "job_id": "c2"})
        assert status == 400 and "already pending" in body["detail"]
        status, stopped = await http("POST", "/stop")
        assert status == 200 and stopped["cancelled_jobs"] == ["c2"], (stopped, await job)
        status, body = await asyncio.wait_for(job, 20)
        assert (status, body["code"]) == (503, "SHUTTING_DOWN"), body
        assert gw.added == {} and gw.buffered == [url]  # taken out of the node, applied again at /start
        await _node_idle(gw)


def test_command_line(stack: tuple[str, str], short_tmp: Path) -> None:
    address, url = stack
    token_file = short_tmp / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    cmd = [sys.executable, "-m", "rolloutd.cli.main", "gateway", "--token-file", str(token_file), "--address", address]
    refused = subprocess.run([*cmd, "--bind", "0.0.0.0:0"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "not a loopback address" in refused.stderr and "--allow-remote" in refused.stderr
    no_token = subprocess.run([*cmd[:4], "--address", address, "--bind", "127.0.0.1:0"], capture_output=True,
                              text=True, timeout=60, env={k: v for k, v in os.environ.items()
                                                          if k != "ROLLOUTD_GATEWAY_TOKEN"})
    assert no_token.returncode == 2 and "bearer token" in no_token.stderr
    with ready_process([*cmd, "--bind", "127.0.0.1:0", "--start", "--inference-server", url]) as (proc, line):
        assert line.startswith("READY http://127.0.0.1:"), (line, proc.stderr.read() if proc.poll() is not None else "")

        async def check(base: str) -> None:
            async with aiohttp.ClientSession(base) as session:
                http = Http(session)
                status, body = await http("GET", "/status")
                assert status == 200 and body["llm_servers"] == [url] and body["address"] == address
                assert (await http("GET", "/status", token=None))[0] == 401

        uvloop.run(check(line.split()[1]))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
