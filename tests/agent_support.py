"""Shared pieces of the agent tests: a real local sandbox, the reference policy server in scripted
mode over real HTTP, a ServerPool, and the trainer-side checks of an outcome's arrays."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
from rolloutd.daemon.agents.base import AgentOutcome
from rolloutd.daemon.agents.context import SandboxAgentContext
from rolloutd.daemon.agents.toolcalls import CODEACT_TOOLS
from rolloutd.daemon.inference.base import GenerateResult, SamplingParams
from rolloutd.daemon.inference.pool import ServerPool
from rolloutd.daemon.policy.model import default_model
from rolloutd.daemon.policy.scripted import ScriptedPlans
from rolloutd.daemon.policy.server import (
    PolicyServerConfig,
    PolicyServerHandle,
    serve_policy,
)
from rolloutd.daemon.policy.tokenizer import load_tokenizer
from rolloutd.daemon.sandbox.base import SandboxBackend, SandboxSpec
from rolloutd.daemon.sandbox.local import LocalBackend
from rolloutd.daemon.sandbox.lease import open_lease
from rolloutd.daemon.tasks.datasets import bundled_dir

API_KEY = "agent-test-key"
BUNDLED = bundled_dir()
EOT = "<|im_end|>"


@functools.cache
def reference_tokenizer() -> Any:
    """Shared by tests that do not change it (loading takes ~0.2 s)."""
    return load_tokenizer()


def call(name: str, text: str = "Next step.", **arguments: Any) -> str:
    """One scripted reply with a Hermes tool call, in the oracle's format."""
    return f"{text}\n<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def load_task(instance_id: str) -> dict[str, Any]:
    return json.loads((BUNDLED / instance_id / "task.json").read_text())


def oracle_replies(instance_id: str) -> list[str]:
    return json.loads((BUNDLED / instance_id / "oracle.json").read_text())["replies"]


def sandbox_python_env(monkeypatch: Any) -> None:
    """Make ``python3`` in a local sandbox's shell the interpreter running the tests (it has pytest),
    without this venv's plugins (they only slow pytest down) or the outer run's PYTHONPATH."""
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.delenv("PYTHONPATH", raising=False)


class RecordingContext(SandboxAgentContext):
    """The pipeline's context, keeping every GenerateResult so tests can compare against them."""

    results: list[GenerateResult]
    server: PolicyServerHandle | None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.results = []
        self.server = None

    async def generate(self, prompt_ids: list[int], *, max_tokens: int, top_logprobs: int = 0) -> GenerateResult:
        result = await super().generate(prompt_ids, max_tokens=max_tokens, top_logprobs=top_logprobs)
        self.results.append(result)
        return result


@contextlib.asynccontextmanager
async def agent_context(state_dir: Path, instance_id: str, replies: list[str], *, repo: Path | None = None,
                        problem: str = "Fix the bug.", ipython: bool = False, tokenizer: Any = None,
                        server_options: dict[str, Any] | None = None, backend: SandboxBackend | None = None,
                        binds: tuple[tuple[str, str, str], ...] = (),
                        **options: Any) -> AsyncIterator[RecordingContext]:
    """A context over a fresh sandbox (of ``backend``, default local; ``repo`` copied into its
    workspace) and a scripted reference server that answers ``instance_id``'s turns with ``replies``."""
    plans = ScriptedPlans(plans={instance_id: replies})
    config = PolicyServerConfig(api_key=API_KEY, scripted=plans, **(server_options or {}))
    async with serve_policy(config) as server, \
            await ServerPool.create([server.url], api_key=API_KEY, health_interval_s=0) as pool:
        lease = await open_lease((backend or LocalBackend(state_dir)).create(SandboxSpec(ipython=ipython, binds=binds)))
        try:
            if repo is not None:
                shutil.copytree(repo, lease.sandbox.workspace, dirs_exist_ok=True)
            ctx = RecordingContext(
                lease=lease, pool=pool, tokenizer=tokenizer or reference_tokenizer(),
                sampling=SamplingParams(max_tokens=4096, temperature=1.0, seed=0), trajectory_id=f"t-{instance_id}",
                instance_id=instance_id, problem_statement=problem, **options)
            ctx.server = server
            yield ctx
        finally:
            await lease.destroy()


def tool_schemas(ipython: bool) -> list[dict[str, Any]]:
    return [s.schema() for s in CODEACT_TOOLS if ipython or s.name != "ipython"]


def rendered_transcript(outcome: AgentOutcome, tokenizer: Any, tools: list[dict[str, Any]]) -> str:
    """The template's rendering of the outcome's transcript, cut where the tokens end."""
    last_is_model = outcome.messages[-1]["role"] == "assistant"
    text = tokenizer.apply_chat_template(outcome.messages, tools=tools, tokenize=False,
                                         add_generation_prompt=not last_is_model)
    if last_is_model:
        # The sequence stops at the model's last token: the template's closing after it is not there.
        ends_with_eot = len(outcome.response_ids) and outcome.response_ids[-1] == tokenizer.convert_tokens_to_ids(EOT)
        text = text.removesuffix("\n")
        if not ends_with_eot:
            text = text.removesuffix(EOT)
    return text


def mask_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def check_outcome(outcome: AgentOutcome, ctx: RecordingContext, tools: list[dict[str, Any]]) -> None:
    """What a trainer may rely on: aligned arrays, mask-1 runs that are exactly the server's turns,
    log-probabilities the reference model reproduces from the ids alone, and ids that decode to the
    template's rendering of the transcript."""
    ids, mask, lps = outcome.response_ids, outcome.response_mask, outcome.response_logprobs
    assert (outcome.prompt_ids.dtype, ids.dtype, mask.dtype, lps.dtype) == (np.int32, np.int32, np.uint8, np.float32)
    assert len(ids) == len(mask) == len(lps)
    assert set(np.unique(mask).tolist()) <= {0, 1}
    assert np.all(lps[mask == 0] == 0.0)
    # Every generated turn is one mask-1 run holding the server's ids and log-probabilities as they are.
    nonempty = [r for r in ctx.results if len(r.token_ids)]
    assert mask_runs(mask) == [(t.start, t.end) for t in outcome.turns if t.end > t.start]
    assert len(outcome.turns) == len(ctx.results) == outcome.num_turns
    for turn, result in zip([t for t in outcome.turns if t.end > t.start], nonempty):
        assert np.array_equal(ids[turn.start:turn.end], result.token_ids)
        assert np.array_equal(lps[turn.start:turn.end], result.logprobs)
        assert (turn.weight_version, turn.server, turn.finish_reason) == \
            (result.weight_version, result.server, result.finish_reason)
    # Fidelity: recompute from the returned arrays alone.
    full = np.concatenate([outcome.prompt_ids, ids])
    recomputed = default_model().sequence_logprobs(full)[len(outcome.prompt_ids):]
    if mask.any():
        assert float(np.abs(recomputed[mask == 1] - lps[mask == 1]).max()) <= 1e-5
    decoded = ctx.tokenizer.decode(full.tolist(), skip_special_tokens=False)
    assert decoded == rendered_transcript(outcome, ctx.tokenizer, tools)
