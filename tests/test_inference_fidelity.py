"""Token-in/token-out fidelity: what the trainer scores is what the model sampled.

Multi-turn trajectories are built the way the agent builds them (prompt, then generated ids with
mask 1 and observation ids with mask 0, nothing re-encoded), through every backend and through a
mixed pool. A trainer-side check then recomputes, from the ids alone, the reference model's
log-probability of every generated token and compares it with what the backend returned.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import numpy as np
import pytest
from inference_support import API_KEY, policy_server
from support.loop import run

from rolloutd.daemon.inference.base import SamplingParams
from rolloutd.daemon.inference.pool import ServerPool
from rolloutd.daemon.policy.model import ReferenceModel, default_model
from rolloutd.daemon.policy.scripted import ScriptedPlans
from rolloutd.daemon.policy.tokenizer import load_tokenizer

TOLERANCE = 1e-5
SAMPLINGS = [
    SamplingParams(max_tokens=24),
    SamplingParams(max_tokens=24, temperature=0.7, top_p=0.9, seed=7),
    SamplingParams(max_tokens=24, temperature=1.3, top_k=50),
    SamplingParams(max_tokens=24, temperature=0.0),
]


@dataclass
class Built:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    response_logprobs: list[float] = field(default_factory=list)
    servers: set[str] = field(default_factory=set)


def trainer_check(model: ReferenceModel, traj: Built) -> float:
    """Max |recomputed - returned| over the generated tokens, from the token arrays alone."""
    mask = np.asarray(traj.response_mask, dtype=bool)
    recomputed = model.token_logprobs(traj.prompt_ids, traj.response_ids)
    returned = np.asarray(traj.response_logprobs, dtype=np.float32)
    assert mask.sum() > 0
    return float(np.abs(recomputed[mask] - returned[mask]).max())


async def build(pool: ServerPool, name: str, prompt: list[int], observations: list[list[int]],
                params: SamplingParams) -> Built:
    traj = Built(prompt_ids=list(prompt))
    for observation in [*observations, []]:
        context = traj.prompt_ids + traj.response_ids
        result = await pool.generate(context, params, trajectory_id=name, timeout_s=30)
        traj.response_ids += result.token_ids.tolist()
        traj.response_mask += [1] * len(result.token_ids)
        traj.response_logprobs += result.logprobs.tolist()
        traj.servers.add(result.server)
        traj.response_ids += observation
        traj.response_mask += [0] * len(observation)
        traj.response_logprobs += [0.0] * len(observation)
    pool.release_trajectory(name)
    return traj


def _prompt_and_observations(tok: object, task: str) -> tuple[list[int], list[list[int]]]:
    encode = tok.encode  # type: ignore[attr-defined]
    prompt = encode(f"<|im_start|>system\nYou are a coding agent.<|im_end|>\n<|im_start|>user\nTask id: {task}\n"
                    "Fix the failing test.<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    observations = [encode(f"\n<|im_start|>user\n<tool_response>\n{text}\n</tool_response><|im_end|>\n"
                           "<|im_start|>assistant\n", add_special_tokens=False)
                    for text in ("1 failed, 5 passed", "edited src/calc.py", "6 passed in 0.03s")]
    return prompt, observations


@pytest.mark.parametrize("spec", ["vllm-generate+", "vllm-completions+", "sglang+", "mixed"])
def test_returned_logprobs_match_the_model_recomputed_from_ids(spec: str) -> None:
    tok = load_tokenizer()

    async def scenario() -> list[Built]:
        async with policy_server() as a, policy_server() as b:
            specs = ["vllm-generate+" + a.url, "sglang+" + b.url] if spec == "mixed" else [spec + a.url]
            async with await ServerPool.create(specs, api_key=API_KEY) as pool:
                jobs = []
                for i in range(8):
                    prompt, observations = _prompt_and_observations(tok, f"task-{i}")
                    jobs.append(build(pool, f"traj-{i}", prompt, observations, SAMPLINGS[i % len(SAMPLINGS)]))
                return list(await asyncio.gather(*jobs))

    trajectories = run(scenario())
    model = default_model()
    errors = [trainer_check(model, t) for t in trajectories]
    assert max(errors) <= TOLERANCE, errors
    assert sum(sum(t.response_mask) for t in trajectories) > 100
    for t in trajectories:
        assert len(t.response_ids) == len(t.response_mask) == len(t.response_logprobs)
    if spec == "mixed":
        assert len(set().union(*(t.servers for t in trajectories))) == 2


def test_the_check_catches_logprobs_that_do_not_belong_to_the_ids() -> None:
    """The check is not vacuous: shifting, splicing or re-scoring the ids breaks it."""
    tok = load_tokenizer()

    async def scenario() -> Built:
        async with policy_server() as srv:
            async with await ServerPool.create([srv.url], api_key=API_KEY) as pool:
                prompt, observations = _prompt_and_observations(tok, "t")
                return await build(pool, "t", prompt, observations, SamplingParams(max_tokens=20, ignore_eos=True))

    traj = run(scenario())
    model = default_model()
    assert trainer_check(model, traj) <= TOLERANCE
    first = traj.response_mask.index(1)
    shifted = Built(traj.prompt_ids, traj.response_ids, traj.response_mask,
                    traj.response_logprobs[:first] + traj.response_logprobs[first + 1:] + [0.0])
    assert trainer_check(model, shifted) > 1e-3
    retokenized = Built(traj.prompt_ids, [traj.response_ids[1], traj.response_ids[0], *traj.response_ids[2:]],
                        traj.response_mask, traj.response_logprobs)
    assert trainer_check(model, retokenized) > 1e-3
    assert trainer_check(ReferenceModel.init(seed=3), traj) > 1e-3


def test_scripted_trajectories_carry_true_logprobs() -> None:
    tok = load_tokenizer()
    plans = ScriptedPlans({"task-0": [
        'Let me run the tests.\n<tool_call>\n{"name": "bash", "arguments": {"command": "pytest -q"}}\n</tool_call>',
        '<tool_call>\n{"name": "edit", "arguments": {"path": "src/calc.py", "old": "a-b", "new": "a+b"}}\n</tool_call>',
        "The tests pass now.",
    ]})

    async def scenario() -> Built:
        async with policy_server(scripted=plans) as srv:
            async with await ServerPool.create([srv.url], api_key=API_KEY) as pool:
                prompt, observations = _prompt_and_observations(tok, "task-0")
                return await build(pool, "s", prompt, observations[:2], SamplingParams(max_tokens=200, seed=1))

    traj = run(scenario())
    assert trainer_check(default_model(), traj) <= TOLERANCE
    text = tok.decode(traj.response_ids)
    assert "pytest -q" in text and "The tests pass now.<|im_end|>" in text
