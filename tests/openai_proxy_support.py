"""Shared pieces of the OpenAI proxy tests: the official ``openai`` SDK made importable inside an
Apptainer sandbox, a context over a real sandbox of either backend with the scripted reference
policy, the test harness's command line, and the checks a trainer relies on."""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import json
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np

from agent_support import API_KEY, RecordingContext, agent_context, call, reference_tokenizer
from rolloutd.client.history_segments import HistorySegment
from rolloutd.native_io.trajectory import Trajectory
from rolloutd.native_io.wire import RolloutArgs, TaskRef
from rolloutd.daemon.inference import ServerPool
from rolloutd.daemon.pipeline.rollout import PipelineLimits, RolloutPipeline
from rolloutd.daemon.policy.server import PolicyServerConfig, serve_policy
from rolloutd.daemon.policy.tokenizer import load_tokenizer
from rolloutd.daemon.sandbox.pool import WarmPool
from rolloutd.daemon.policy.model import default_model
from rolloutd.daemon.sandbox.apptainer import ApptainerBackend
from rolloutd.daemon.sandbox.base import SandboxBackend
from rolloutd.daemon.sandbox.local import LocalBackend

REPO = Path(__file__).resolve().parent.parent
HARNESS_DIR = REPO / "tests" / "openai_harness"
SDK_INSIDE = "/opt/rolloutd-openai-sdk"
HARNESS_INSIDE = "/opt/rolloutd-openai-harness"
SANDBOX_PYTHON = "3.11"
"""The default image's Python (Debian bookworm)."""
OUT = "harness_out.json"

BASH_TOOL = {"type": "function", "function": {
    "name": "bash", "description": "Run a bash command in the repository.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
"""What the harness offers (tests/openai_harness/harness.py)."""

TOOLS_PLAN = [
    call("bash", "I will list the files.", command="ls"),
    "Two checks at once.\n" + "\n".join(
        f"<tool_call>\n{json.dumps({'name': 'bash', 'arguments': {'command': c}})}\n</tool_call>"
        for c in ("cat notes.txt", "echo checked")),
    "All done: notes.txt holds the answer.",
]
"""Three model turns: one tool call, two parallel calls, a final answer."""


def sandbox_sdk_dir(package: str = "openai") -> Path:
    """The SDK ``package`` (``openai``, ``anthropic``) of this venv's version with its
    dependencies, installed once for the sandbox's Python into ``.cache/`` of the checkout (binary
    wheels for that Python, so it works whatever Python runs the tests)."""
    version = importlib.metadata.version(package)
    target = REPO / ".cache" / "sandbox-sdk" / f"{package}-{version}-py{SANDBOX_PYTHON}"
    if (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / ".complete").exists():
            staging = target.with_name(target.name + ".partial")
            shutil.rmtree(staging, ignore_errors=True)
            argv = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--target",
                    str(staging), "--python-version", SANDBOX_PYTHON, "--implementation", "cp",
                    "--only-binary=:all:", f"{package}=={version}"]
            run = subprocess.run(argv, capture_output=True, text=True, timeout=300)
            if run.returncode != 0:
                raise RuntimeError(f"could not install the {package} SDK for the sandbox ({' '.join(argv)}): "
                                   f"{run.stderr[-2000:]}")
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
            (target / ".complete").touch()
    return target


def sandbox_backend(kind: str, state_dir: Path) -> SandboxBackend:
    return ApptainerBackend(state_dir, uncontained_root_ok=True) if kind == "apptainer" else LocalBackend(state_dir)


def harness_command(backend: str, *flags: str, script: str = "harness.py") -> str:
    folder = HARNESS_INSIDE if backend == "apptainer" else str(HARNESS_DIR)
    return " ".join(["python3", f"{folder}/{script}", "--out", OUT, *flags])


def harness_env(backend: str) -> dict[str, str]:
    return {"PYTHONPATH": SDK_INSIDE} if backend == "apptainer" else {}


def sandbox_binds(backend: str, sdk: str = "openai") -> tuple[tuple[str, str, str], ...]:
    if backend != "apptainer":
        return ()
    return ((str(sandbox_sdk_dir(sdk)), SDK_INSIDE, "ro"), (str(HARNESS_DIR), HARNESS_INSIDE, "ro"))


@contextlib.asynccontextmanager
async def proxy_context(kind: str, state_dir: Path, instance_id: str, replies: list[str], *,
                        files: dict[str, str] | None = None, problem: str = "Report what notes.txt says.",
                        **options: Any) -> AsyncIterator[RecordingContext]:
    """A context over a fresh sandbox of backend ``kind`` (``files`` written into its workspace,
    the SDK and the harness bound in for Apptainer) and a scripted reference server answering
    ``instance_id``'s turns with ``replies``."""
    backend = sandbox_backend(kind, state_dir)
    async with agent_context(state_dir, instance_id, replies, problem=problem, backend=backend,
                             binds=sandbox_binds(kind), **options) as ctx:
        for name, text in (files or {}).items():
            (ctx.lease.sandbox.workspace / name).write_text(text)
        yield ctx
    # This test's own sandbox is gone (the global leak check also counts other runs' instances).
    assert ctx.lease.sandbox.stop_rung is not None
    if isinstance(backend, ApptainerBackend):
        assert backend.leftover_instances() == []


async def run_blackbox(state_dir: Path, backend: str, task: TaskRef, plans: dict[str, list[str]],
                       agent_config: dict[str, Any], *, sdk: str = "openai", n: int = 1,
                       max_tokens: int = 256, binds: tuple[tuple[str, str, str], ...] = ()) -> list[Trajectory]:
    """``n`` rollouts of ``task`` through a RolloutPipeline with the ``blackbox`` agent on
    ``agent_config``, in sandboxes of ``backend`` (the SDK ``sdk`` and the test harnesses bound in
    for Apptainer, and ``binds``), against the reference server following ``plans``."""
    plans_file = state_dir / "plans.json"
    plans_file.write_text(json.dumps({"plans": plans}))
    async with serve_policy(PolicyServerConfig(api_key=API_KEY, scripted=plans_file)) as policy:
        sandboxes = WarmPool(sandbox_backend(backend, state_dir / "sb"), warm_specs={})
        await sandboxes.start()
        inference = await ServerPool.create([policy.url], api_key=API_KEY)
        pipe = RolloutPipeline(sandboxes=sandboxes, inference=inference, tokenizer=load_tokenizer(),
                               limits=PipelineLimits(), cache_dir=state_dir / "cache",
                               binds=sandbox_binds(backend, sdk) + binds)
        try:
            args = RolloutArgs(task=task, agent="blackbox", ipython=False, n=n, agent_config=agent_config,
                               sampling={"max_tokens": max_tokens, "seed": 1})
            return await pipe.run_request("bb", args)
        finally:
            await inference.close()
            await sandboxes.close()


def harness_output(ctx: RecordingContext) -> dict[str, Any]:
    return json.loads((ctx.lease.sandbox.workspace / OUT).read_text())


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The harness's messages as the chat template takes them (arguments as objects)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


def render_as_harness_sees_it(messages: list[dict[str, Any]], tools: list[dict[str, Any]], *,
                              ends_with_eot: bool) -> str:
    """A fresh render of the harness's final conversation, cut where a trajectory's tokens end
    (after the model's last token: no newline after it, and no end-of-turn when it was cut)."""
    text = reference_tokenizer().apply_chat_template(template_messages(messages), tools=tools, tokenize=False)
    text = text.removesuffix("\n")
    return text if ends_with_eot else text.removesuffix("<|im_end|>")


def check_segment_fidelity(segment: HistorySegment) -> None:
    """The reference model, given only this segment's ids, reproduces every mask-1 log-probability."""
    mask = segment.response_mask
    assert mask.any()
    assert np.all(segment.response_logprobs[mask == 0] == 0.0)
    full = np.concatenate([segment.prompt_ids, segment.response_ids])
    recomputed = default_model().sequence_logprobs(full)[len(segment.prompt_ids):]
    assert float(np.abs(recomputed[mask == 1] - segment.response_logprobs[mask == 1]).max()) <= 1e-5
    for turn in segment.turns:
        assert np.all(mask[turn.start:turn.end] == 1)


def decode(ids: np.ndarray) -> str:
    return reference_tokenizer().decode(ids.tolist(), skip_special_tokens=False)
