"""The published rollout server's clients: their request-building and response-parsing logic,
written here for the tests from a reading of the upstream code (not copied), each function naming
the path it mirrors. Upstream: NVIDIA-NeMo/ProRL-Agent-Server at 40c1d8a (``scripts/tests/
test_server.py``, ``scripts/tests/test_server_token.py``) and yuki-97/NeMo-RL-ProRL
(``nemo_rl/environments/openhands_environment.py``, class ``OpenhandsEnvironment``).

What they share: plain aiohttp, no ``Authorization`` header, a fixed base URL, JSON bodies, and on
a non-200 status the body printed or logged and the sample given up (``None``) or retried.
"""

from __future__ import annotations

import copy
from typing import Any

import aiohttp

V1_SAMPLING_PARAMS: dict[str, Any] = {
    # test_server.py, process(): their LLM client's settings plus one agent setting
    "model": "hosted_vllm/Qwen/Qwen3-8B", "api_key": "mykey", "modify_params": False, "log_completions": False,
    "native_tool_calling": True, "temperature": 0.6, "top_p": 0.9, "max_iterations": 1,
}
TOKEN_SAMPLING_PARAMS: dict[str, Any] = {
    # test_server_token.py, process(): the token-level run (Qwen3 tokenizer, output and context caps)
    **V1_SAMPLING_PARAMS, "max_iterations": 35, "token_level_generation": True, "custom_tokenizer": "Qwen/Qwen3-8B",
    "max_output_tokens": 4096, "max_model_len": 32768,
}
NEMO_RL_SAMPLING_PARAMS: dict[str, Any] = {
    # OpenhandsEnvironment.__init__, self.sampling_params (max_output_tokens left to request time)
    "model": "hosted_vllm/Qwen/Qwen3-8B", "api_key": "dummy_key", "modify_params": False, "log_completions": False,
    "native_tool_calling": True, "temperature": 1.0, "top_p": 1.0, "max_iterations": 8,
    "token_level_generation": True, "custom_tokenizer": "Qwen/Qwen3-8B", "max_model_len": 32768,
    "ensure_thinking_end_properly": True,
}


async def control(base: str, route: str, payload: dict[str, Any] | None = None) -> tuple[int, Any]:
    """test_server*.py start_server / stop_server / get_status / add_llm_server and the
    environment's _start_single_server / _stop_single_server / _clear_llm_servers_single_server /
    _add_llm_server_to_openhands: one session per call, POST (GET for /status), JSON on 200."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        method = session.get if route == "/status" else session.post
        kwargs = {"json": payload} if payload is not None else {}
        async with method(f"{base}{route}", **kwargs) as response:
            if response.status == 200:
                return 200, await response.json()
            return response.status, await response.text()


async def v1_process_request(base: str, instance: dict[str, Any],
                             sampling_params: dict[str, Any] | None) -> dict[str, Any] | None:
    """test_server.py process_request: the result with ``messages`` and ``tools`` replaced by
    their lengths (a KeyError there if either is missing), or None on a non-200."""
    async with aiohttp.ClientSession() as session:
        payload = {"instance": instance, "sampling_params": sampling_params or {}}
        async with session.post(f"{base}/process", json=payload) as response:
            if response.status != 200:
                await response.json()
                return None
            result = await response.json()
            result["messages"] = len(result["messages"])
            result["tools"] = len(result["tools"])
            return result


async def token_process_request(base: str, instance: dict[str, Any],
                                sampling_params: dict[str, Any] | None) -> dict[str, Any] | None:
    """test_server_token.py process_request: POST, then :func:`token_parse` on a 200, None otherwise."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3000)) as session:
        payload = {"instance": instance, "sampling_params": sampling_params or {}}
        async with session.post(f"{base}/process", json=payload) as response:
            if response.status != 200:
                await response.json()
                return None
            return token_parse(await response.json())


def token_parse(raw: dict[str, Any]) -> dict[str, Any]:
    """test_server_token.py process_request's parse: per message, ``content`` and ``token_ids``
    must have a length, ``tool_calls`` and ``input_ids`` too when present and not None; ``tools`` a
    length. Returns the parsed result (lengths in place of the lists) and, untouched, the raw one."""
    result = copy.deepcopy(raw)
    for message in result["messages"]:
        message["content"] = len(message["content"])
        if message.get("tool_calls") is not None:
            message["tool_calls"] = len(message["tool_calls"])
        if message.get("input_ids") is not None:
            message["input_ids"] = len(message["input_ids"])
        message["token_ids"] = len(message["token_ids"])
    result["tools"] = len(result["tools"])
    return {"parsed": result, "raw": raw}


def published_check(result: dict[str, Any]) -> None:
    """test_server*.py __main__: every result of a healthy run has ``critical_error`` None."""
    assert result["critical_error"] is None, f"Critical error in task: {result}"


def nemo_rl_instances(instances: list[dict[str, Any]], num_trajectories: int) -> list[dict[str, Any]]:
    """OpenhandsEnvironment.BatchedDataDict2Messages: each instance copied per trajectory, with
    ``trajectory_id`` 0..n-1."""
    return [{**instance, "trajectory_id": j} for instance in instances for j in range(num_trajectories)]


async def nemo_rl_send(base: str, message: dict[str, Any],
                       sampling_params: dict[str, Any]) -> tuple[dict[str, Any] | None, bool]:
    """OpenhandsEnvironment._send_single_message_to_openhands: POST with a JSON content type and no
    job_id, then :func:`nemo_rl_accept`."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        async with session.post(f"{base}/process", headers={"Content-Type": "application/json"},
                                json={"instance": message, "sampling_params": sampling_params}) as resp:
            return nemo_rl_accept(resp.status, await resp.json() if resp.status == 200 else await resp.text())


def nemo_rl_accept(status: int, body: Any) -> tuple[dict[str, Any] | None, bool]:
    """Both NeMo-RL environments' reading of a /process answer: ``(data, should_retry)``; a 200
    whose ``messages`` is empty or missing, and any other status, mean retry."""
    if status != 200:
        return None, True
    return (body, False) if body.get("messages") else (None, True)


def nemo_rl_tokens(result: dict[str, Any]) -> dict[str, list[Any]]:
    """OpenhandsEnvironment.Results2BatchedDataDict, for one result before padding: the prompt is
    every message before the first assistant one, the response the rest; ``assistant_masks`` 1 on
    assistant messages; missing logprobs are zeros; the last message must be the assistant's."""
    messages = result.get("messages", [])
    start = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), 0)
    if start == 0:
        start = len(messages)
    assert messages[-1]["role"] == "assistant", f"The last message should be an assistant message: {messages}"
    all_ids = [m["token_ids"] for m in messages]
    all_logprobs = [m["logprobs"] if m.get("logprobs") is not None else [0.0] * len(m["token_ids"])
                    for m in messages]
    masks = [[1 if m["role"] == "assistant" else 0] * len(m["token_ids"]) for m in messages]
    prompt_ids = sum(all_ids[:start], [])
    return {
        "prompt_ids": prompt_ids,
        "response_ids": sum(all_ids[start:], []),
        "assistant_masks": sum(masks, [])[len(prompt_ids):],
        "log_probs": sum(all_logprobs[start:], []),
        "success": result.get("success", False), "error": result.get("error"),
        "resolved": result.get("resolved", False), "finish": result.get("finish", False),
    }


async def dapo_process(base: str, message: dict[str, Any], sampling_params: dict[str, Any],
                       job_id: str) -> tuple[int, Any]:
    """NeMo-RL-ProRL's DAPO environment (openhands_environment_dapo.py,
    _send_single_message_to_openhands_dapo): the body carries its own ``job_id``; when its caller
    cancels it, it posts ``/cancel`` for that job before giving up. Returns the status and body
    (the environment then applies :func:`nemo_rl_accept`)."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1000)) as session:
            payload = {"job_id": job_id, "instance": message, "sampling_params": sampling_params}
            async with session.post(f"{base}/process", headers={"Content-Type": "application/json"},
                                    json=payload) as resp:
                return resp.status, await resp.json() if resp.status == 200 else await resp.text()
    except BaseException:
        if not await dapo_cancel(base, job_id):
            raise AssertionError(f"/cancel of {job_id} was refused") from None
        raise


async def dapo_cancel(base: str, job_id: str) -> bool:
    """The DAPO environment's cancel_job: POST /cancel {"job_id"}; True on 200."""
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{base}/cancel", json={"job_id": job_id}) as resp:
            return resp.status == 200
