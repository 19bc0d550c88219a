"""Real rollouts for the trainer tests: a scripted policy and a node daemon, and one GRPO group of
samples that differ the way a trainer must tell apart: solved (reward 1), given up (a real
reward of 0, to train on) and ended by infrastructure (no reward: to drop)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import os
from pathlib import Path

from daemon_fixtures import policy_and_node

from rolloutd.client import RolloutClient, RolloutRequest
from rolloutd.daemon.policy.tiny_model import TinyModelSpec, ensure_tiny_model

API_KEY = "trainer-test-key"
ROLLOUT_TIMEOUT_S = 480.0
"""One group's rollouts on a 2-core machine other jobs load heavily (each takes seconds alone)."""

SUBMIT = '<tool_call>\n{"name": "submit", "arguments": {}}\n</tool_call>'
WRITE = 'Writing it.\n<tool_call>\n{"name": "bash", "arguments": {"command": "echo hi > out.txt"}}\n</tool_call>'
EVAL = 'test "$(cat out.txt 2>/dev/null)" = hi && echo 1 || echo 0'
# More processes than a sandbox may run (max_processes 512): the daemon's watchdog destroys the
# sandbox under the set-up, which no model can cause or help: an infrastructure ending.
FORK_FLOOD = "for i in $(seq 600); do sleep 30 & done; wait"

PLANS = {"echo-solve": [WRITE, SUBMIT], "echo-giveup": [SUBMIT], "echo-infra": [SUBMIT]}


def task(instance_id: str, setup: str = "") -> dict[str, object]:
    return {"type": "command", "instance_id": instance_id, "problem_statement": "Write hi into out.txt.",
            "setup_script": setup, "eval_script": EVAL}


def group_requests(n: int, *, max_tokens: int = 256) -> list[RolloutRequest]:
    """One group of ``n`` >= 4 samples of the same job: ``n - 2`` solved, 1 given up, 1 infra-failed
    (in that order; no refill, so the infrastructure ending comes back as it happened)."""
    if n < 4:
        raise ValueError(f"a mixed group needs at least 4 samples, got {n}")
    sampling = {"max_tokens": max_tokens, "seed": 1}
    return [RolloutRequest(task=task("echo-solve"), n=n - 2, sampling=sampling),
            RolloutRequest(task=task("echo-giveup"), n=1, sampling=sampling),
            RolloutRequest(task=task("echo-infra", FORK_FLOOD), n=1, sampling=sampling, infra_retries=0)]


@contextmanager
def rollout_client() -> Iterator[RolloutClient]:
    """A client of a node daemon (local sandboxes) whose inference server is the scripted policy."""
    with policy_and_node(PLANS, API_KEY, "--backend", "local", "--workers", "1", "--warm", "2",
                         prefix="rld-trainer-") as (address, url):
        with RolloutClient(address) as client:
            assert client.add_inference_server(url)["workers"]
            yield client


def tiny_model_dir() -> Path:
    """The tiny Qwen2 test model (built once into the cache; its tokenizer is the policy's)."""
    repo = Path(__file__).resolve().parent.parent
    return ensure_tiny_model(Path(os.environ.get("ROLLOUTD_CACHE_DIR", repo / ".cache")), TinyModelSpec())


def expected_rewards(n: int) -> list[float | None]:
    """What :func:`group_requests` scores, None where there is no score."""
    return [1.0] * (n - 2) + [0.0, None]

