"""The OpenAI proxy served in the test process: a ProxySession on a real Unix socket, the official
``openai`` SDK as the client, and the reference policy server (scripted plans) behind a ServerPool
over real HTTP; with the helpers a harness loop needs (echo a reply, answer a tool call)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai

from agent_support import API_KEY, call, reference_tokenizer
from openai_proxy_support import BASH_TOOL
from rolloutd.daemon.inference.base import GenerateResult, SamplingParams
from rolloutd.daemon.inference.pool import ServerPool
from rolloutd.daemon.openai_proxy.server import MAX_BODY_BYTES, OpenAIProxyServer
from rolloutd.daemon.openai_proxy.session import ProxyLimits, ProxySession
from rolloutd.daemon.policy.scripted import ScriptedPlans
from rolloutd.daemon.policy.server import PolicyServerConfig, serve_policy
from rolloutd.native_io.errors import InferenceError

try:
    import httpx2 as httpx
except ImportError:  # older SDKs use httpx
    import httpx  # type: ignore[no-redef]

KEY = "proxy-test-key"
MODEL = "test-policy"
PLANS = {
    "p-1": [call("bash", "I will list the files.", command="ls"), call("bash", "And the notes.", command="cat notes"),
            "Done."],
    "p-2": ["Second conversation, first reply.", "Second conversation, second reply."],
}


@dataclass
class Proxy:
    client: openai.AsyncOpenAI
    session: ProxySession
    server: OpenAIProxyServer
    socket: Path
    results: list[GenerateResult] = field(default_factory=list)
    fail_next: int = 0
    """Model turns that fail (InferenceError) before reaching the server."""

    def raw(self) -> httpx.AsyncClient:
        """A plain HTTP client on the proxy's socket (for what the SDK would not send)."""
        return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(self.socket)),
                                 base_url="http://localhost", headers={"Authorization": f"Bearer {KEY}"})


@contextlib.asynccontextmanager
async def proxy(state: Path, *, key: str = KEY, max_retries: int = 0, plans: dict[str, list[str]] | None = None,
                tokenizer: Any = None, max_body_bytes: int = MAX_BODY_BYTES, **limits: Any) -> AsyncIterator[Proxy]:
    async with serve_policy(PolicyServerConfig(api_key=API_KEY, scripted=ScriptedPlans(plans or PLANS))) as policy, \
            await ServerPool.create([policy.url], api_key=API_KEY, health_interval_s=0) as pool:
        holder: list[Proxy] = []

        async def generate(ids: list[int], max_tokens: int, top_logprobs: int) -> GenerateResult:
            p = holder[0]
            if p.fail_next:
                p.fail_next -= 1
                raise InferenceError("injected failure: every server failed this turn")
            params = SamplingParams(max_tokens=max_tokens, seed=0, top_logprobs=top_logprobs)
            result = await pool.generate(ids, params, trajectory_id="t", timeout_s=30)
            p.results.append(result)
            return result

        session = ProxySession(generate, tokenizer or reference_tokenizer(), model=MODEL,
                               limits=ProxyLimits(**limits))
        server = OpenAIProxyServer(session, api_key=KEY, socket_path=state / "api.sock", max_body_bytes=max_body_bytes)
        await server.start()
        client = openai.AsyncOpenAI(api_key=key, base_url="http://localhost/v1", max_retries=max_retries,
                                    http_client=openai.DefaultAsyncHttpxClient(
                                        transport=httpx.AsyncHTTPTransport(uds=str(state / "api.sock"))))
        holder.append(Proxy(client, session, server, state / "api.sock"))
        try:
            yield holder[0]
        finally:
            await client.close()
            await server.close()


def conversation(task: str = "p-1") -> list[dict[str, Any]]:
    return [{"role": "system", "content": "You are a test agent."},
            {"role": "user", "content": f"Task id: {task}\nLook around."}]


def as_sent(message: Any) -> dict[str, Any]:
    """A reply as a harness sends it back."""
    return message.model_dump(exclude_none=True, include={"role", "content", "tool_calls"})


async def turn(p: Proxy, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    kwargs.setdefault("tools", [BASH_TOOL])
    reply = await p.client.chat.completions.create(model=MODEL, messages=messages, **kwargs)
    return reply.choices[0]


def tool_result(choice: Any, content: str, index: int = 0, *, name: bool = False) -> dict[str, Any]:
    """The harness's answer to the reply's ``index``-th tool call (with the tool's name if ``name``)."""
    call_ = choice.message.tool_calls[index]
    out = {"role": "tool", "tool_call_id": call_.id, "content": content}
    return {**out, "name": call_.function.name} if name else out
