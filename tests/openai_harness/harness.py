"""A black-box agent harness for the proxy tests: the official ``openai`` SDK, run inside a sandbox.

It reads the task message from ``$ROLLOUTD_TASK_PROMPT_FILE``, offers one ``bash`` tool, runs
every tool call itself (a subprocess in its working folder) and sends the results back as tool
messages, until the model answers without a tool call. It writes what it saw to ``--out``
(JSON: the final messages, each reply's finish reason, stream statistics, the listed models).

    --stream        ask for streamed replies and rebuild each message from the deltas
    --uds           reach the proxy's Unix socket directly (an httpx transport) instead of the URL
    --rewrite-at N  before request N (1-based), replace the first assistant reply's content
                    (a history rewrite the proxy must flag)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import openai
from harness_io import run_bash, write_output

try:  # the SDK's HTTP client: httpx in 1.x/2.x, httpx2 in later releases
    import httpx2 as httpx
except ImportError:
    import httpx

SYSTEM = "You are a test harness agent. Use the bash tool to inspect the repository."
BASH = {"type": "function", "function": {
    "name": "bash", "description": "Run a bash command in the repository.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}


def make_client(uds: bool, api_key: str | None = None) -> openai.OpenAI:
    # OPENAI_BASE_URL and OPENAI_API_KEY come from the agent.
    if not uds:
        return openai.OpenAI(api_key=api_key, max_retries=0)
    transport = httpx.HTTPTransport(uds=os.environ["ROLLOUTD_OPENAI_SOCKET"])
    return openai.OpenAI(api_key=api_key, base_url="http://localhost/v1", max_retries=0,
                         http_client=openai.DefaultHttpxClient(transport=transport))


def wrong_key_error(uds: bool) -> str:
    """What the proxy answers a client holding another key."""
    try:
        make_client(uds, api_key="not-this-rollouts-key").models.list()
    except openai.APIStatusError as e:
        return f"{type(e).__name__} {e.status_code}"
    return "accepted"


def streamed(client: openai.OpenAI, stats: dict, **kwargs: object) -> tuple[dict, str]:
    message: dict = {"role": "assistant", "content": "", "tool_calls": []}
    finish = ""
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        stats["chunks"] += 1
        if chunk.usage is not None:
            stats["usage_chunks"] += 1
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        if delta.content:
            message["content"] += delta.content
            stats["content_deltas"] += 1
        for call in delta.tool_calls or []:
            while len(message["tool_calls"]) <= call.index:
                message["tool_calls"].append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            slot = message["tool_calls"][call.index]
            slot["id"] = call.id or slot["id"]
            if call.function is not None:
                slot["function"]["name"] += call.function.name or ""
                slot["function"]["arguments"] += call.function.arguments or ""
            stats["tool_call_deltas"] += 1
        finish = choice.finish_reason or finish
    if not message["tool_calls"]:
        del message["tool_calls"]
    return message, finish


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--uds", action="store_true")
    parser.add_argument("--rewrite-at", type=int, default=0)
    parser.add_argument("--max-requests", type=int, default=10)
    args = parser.parse_args()
    client = make_client(args.uds)
    model = os.environ["ROLLOUTD_MODEL"]
    with open(os.environ["ROLLOUTD_TASK_PROMPT_FILE"]) as f:
        task = f.read()
    messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
    seen = {"models": [m.id for m in client.models.list()], "finish_reasons": [], "tool_outputs": [],
            "stream": {"chunks": 0, "usage_chunks": 0, "content_deltas": 0, "tool_call_deltas": 0},
            "usage": [], "sdk_version": openai.__version__, "wrong_key": wrong_key_error(args.uds)}
    for request in range(1, args.max_requests + 1):
        if request == args.rewrite_at:
            first = next(m for m in messages if m["role"] == "assistant")
            first["content"] = "I rewrote this reply."
        kwargs = {"model": model, "messages": messages, "tools": [BASH]}
        if args.stream:
            message, finish = streamed(client, seen["stream"], **kwargs)
        else:
            reply = client.chat.completions.create(**kwargs)
            choice = reply.choices[0]
            message = choice.message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"})
            finish = choice.finish_reason
            seen["usage"].append(reply.usage.model_dump())
        seen["finish_reasons"].append(finish)
        messages.append(message)
        if not message.get("tool_calls"):
            break
        for call in message["tool_calls"]:
            command = json.loads(call["function"]["arguments"])["command"]
            output = run_bash(command)
            seen["tool_outputs"].append(output)
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": output})
    return write_output(args.out, seen, messages)


if __name__ == "__main__":
    sys.exit(main())
