"""veRL's own AgentLoopWorker runs rolloutd's registered agent loop on real rollouts (CPU).

The worker is veRL's (built from its own ppo_trainer config on the tiny Qwen2 model's folder);
it instantiates the loop from its registry with hydra, calls ``run``, pads and batches the
``AgentLoopOutput``s with its own post-processing into a ``DataProto``. What veRL cannot do here
is the GPU part after it (actor update on FSDP/Megatron workers); the advantages are computed by
veRL's own GRPO estimator on the batch, after the unscored row is dropped.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from adapters_support import real_module, trajectories
from trainer_support import (
    API_KEY, PLANS, ROLLOUT_TIMEOUT_S, WRITE, expected_rewards, group_requests, tiny_model_dir,
)
from daemon_fixtures import policy_and_node

from rolloutd.client import RolloutClient
from rolloutd.client.adapters.verl import drop_unscored, to_verl_batch
from rolloutd.native_io.errors import BadRequest

GROUP = 4
PROMPT_LENGTH, RESPONSE_LENGTH = 2048, 512


def verl_config(model_dir: Path, loops_yaml: Path) -> Any:
    """veRL's own ppo_trainer config, pointed at the tiny model and at rolloutd's agent loop."""
    verl = real_module("verl")
    hydra = real_module("hydra")
    overrides = [
        f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.rollout.prompt_length={PROMPT_LENGTH}",
        f"actor_rollout_ref.rollout.response_length={RESPONSE_LENGTH}",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "actor_rollout_ref.rollout.agent.default_agent_loop=rolloutd",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops_yaml}",
    ]
    config_dir = Path(verl.__file__).parent / "trainer" / "config"
    with hydra.initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return hydra.compose(config_name="ppo_trainer", overrides=overrides)


def objects(items: list[Any]) -> np.ndarray:
    """A 1-D object column (numpy would make a list of equal-length lists 2-D)."""
    column = np.empty(len(items), dtype=object)
    column[:] = items
    return column


def input_batch(protocol: Any) -> Any:
    """One GRPO group as veRL's trainer hands it to the rollout: rows repeated, one shared uid."""
    requests = []
    for r in group_requests(GROUP):
        fields = {"task": r.task, "sampling": r.sampling, "infra_retries": r.infra_retries}
        requests += [fields] * r.n
    return protocol.DataProto.from_dict(non_tensors={
        "raw_prompt": objects([[{"role": "user", "content": "write hi"}]] * GROUP),
        "rolloutd_request": objects(requests),
        "uid": np.array(["group-0"] * GROUP, dtype=object),
        "index": np.arange(GROUP),
    })


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_verl_agent_loop_worker_runs_rolloutd_loop(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    agent_loop = real_module("verl.experimental.agent_loop.agent_loop")
    protocol = real_module("verl.protocol")
    core_algos = real_module("verl.trainer.ppo.core_algos")
    torch = real_module("torch")
    transformers = real_module("transformers")
    from rolloutd.client.adapters import verl_agent_loop  # registers "rolloutd" in veRL's registry

    assert agent_loop._agent_loop_registry["rolloutd"]["_target_"] == (
        "rolloutd.client.adapters.verl_agent_loop.RolloutdAgentLoop")
    model_dir = tiny_model_dir()
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)

    with policy_and_node(PLANS, API_KEY, "--backend", "local", "--workers", "1", "--warm", "2",
                         prefix="rld-verl-") as (address, url):
        with RolloutClient(address) as client:
            assert client.add_inference_server(url)["workers"]
        # veRL's documented way to give a registered loop its arguments: an agent-loop config file.
        loops = short_tmp / "agent_loops.yaml"
        loops.write_text(f"- name: rolloutd\n  _target_: {verl_agent_loop.__name__}.RolloutdAgentLoop\n"
                         f"  rolloutd_address: '{address}'\n  rolloutd_timeout_s: {ROLLOUT_TIMEOUT_S}\n")
        worker = agent_loop.AgentLoopWorker(verl_config(model_dir, loops), llm_client=None)
        out = asyncio.run(worker.generate_sequences(input_batch(protocol)))

    assert isinstance(out, protocol.DataProto) and len(out) == GROUP
    rewards = [None if not v else float(s) for v, s in
               zip(out.non_tensor_batch["reward_valid"], out.batch["rm_scores"].sum(-1).tolist())]
    assert rewards == expected_rewards(GROUP), out.non_tensor_batch["ended_by"]
    assert out.non_tensor_batch["ended_by"].tolist() == ["model"] * (GROUP - 1) + ["sandbox"]
    assert set(out.meta_info["metrics"][0]) == set(agent_loop.AgentLoopMetrics.model_fields)
    reply = tokenizer.encode(WRITE, add_special_tokens=False)
    for i in range(GROUP):
        attention = out.batch["attention_mask"][i].bool()
        prompt = out.batch["prompts"][i][attention[:PROMPT_LENGTH]].tolist()
        response = out.batch["responses"][i][attention[PROMPT_LENGTH:]].tolist()
        mask = out.batch["response_mask"][i][: len(response)]
        logprobs = out.batch["rollout_log_probs"][i][: len(response)]
        assert out.batch["input_ids"][i][attention].tolist() == prompt + response
        assert (logprobs[mask == 0] == 0).all() and (logprobs[mask == 1] < 0).all()
        if i < GROUP - 2:  # the scripted policy's planned reply, token for token, trained on
            assert response[: len(reply)] == reply and mask[: len(reply)].all()
    assert out.batch["response_mask"][-1].sum() == 0  # the infra-failed row trains no token

    # veRL's GRPO baseline counts every row of a uid: the unscored row must leave before it.
    kept = drop_unscored(out)
    assert len(kept) == GROUP - 1 and kept.non_tensor_batch["ended_by"].tolist() == ["model"] * (GROUP - 1)
    advantages, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=kept.batch["rm_scores"], response_mask=kept.batch["response_mask"],
        index=kept.non_tensor_batch["uid"])
    scores = torch.tensor([1.0] * (GROUP - 2) + [0.0])
    expected = (scores - scores.mean()) / (scores.std() + 1e-6)
    per_row = advantages.sum(-1) / kept.batch["response_mask"].sum(-1)
    assert torch.allclose(per_row, expected, atol=1e-5), per_row
    with_zero, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=out.batch["rm_scores"], response_mask=out.batch["response_mask"],
        index=out.non_tensor_batch["uid"])
    assert not torch.allclose(with_zero.sum(-1)[: GROUP - 1] / kept.batch["response_mask"].sum(-1), expected)


def test_drop_unscored_on_the_adapters_batches() -> None:
    trajs = trajectories()  # the last one ended by the sandbox
    plain = drop_unscored(to_verl_batch(trajs, use_trainer_class=False))
    assert plain.non_tensor_batch["request_id"].tolist() == ["a", "b", "c"]
    assert plain.batch["responses"].shape[0] == 3
    protocol = real_module("verl.protocol")
    kept = drop_unscored(to_verl_batch(trajs))
    assert isinstance(kept, protocol.DataProto) and kept.non_tensor_batch["request_id"].tolist() == ["a", "b", "c"]
    bare = to_verl_batch(trajs, use_trainer_class=False)
    del bare.non_tensor_batch["reward_valid"]
    with pytest.raises(BadRequest, match="reward_valid"):
        drop_unscored(bare)
