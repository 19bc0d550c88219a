"""A black-box harness on Anthropic's SDK, run inside a sandbox: what a Claude-Code-style agent
does with the Messages API. The client is configured only by the environment the ``blackbox``
agent gives it (``ANTHROPIC_BASE_URL``, ``ANTHROPIC_API_KEY``). It reads the task message from
``$ROLLOUTD_TASK_PROMPT_FILE``, offers one ``bash`` tool, streams every reply, runs each
``tool_use`` itself and sends the results back as ``tool_result`` blocks, until the model
answers without a tool. It writes what it saw to ``--out`` (JSON: the messages, stop reasons)."""

from __future__ import annotations

import argparse
import os
import sys

import anthropic
from harness_io import run_bash, write_output

SYSTEM = "You are a test harness agent. Use the bash tool to inspect the repository."
BASH = {"name": "bash", "description": "Run a bash command in the repository.",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-requests", type=int, default=10)
    args = parser.parse_args()
    client = anthropic.Anthropic(max_retries=0)
    with open(os.environ["ROLLOUTD_TASK_PROMPT_FILE"]) as f:
        messages: list[dict] = [{"role": "user", "content": f.read()}]
    seen: dict = {"stop_reasons": [], "sdk_version": anthropic.__version__}
    for _ in range(args.max_requests):
        with client.messages.stream(model=os.environ["ROLLOUTD_MODEL"], system=SYSTEM, messages=messages,
                                    tools=[BASH], max_tokens=512) as stream:
            reply = stream.get_final_message()
        seen["stop_reasons"].append(reply.stop_reason)
        messages.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in reply.content]})
        uses = [b for b in reply.content if b.type == "tool_use"]
        if not uses:
            break
        results = []
        for use in uses:
            results.append({"type": "tool_result", "tool_use_id": use.id, "content": run_bash(use.input["command"])})
        messages.append({"role": "user", "content": results})
    return write_output(args.out, seen, messages)


if __name__ == "__main__":
    sys.exit(main())
