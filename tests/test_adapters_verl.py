"""veRL adapter: agent-loop records and the padded DataProto batch, against veRL's field names.

Field lists below are taken from verl-project/verl 1dda039 (same in release 0.9.1):
verl/experimental/agent_loop/agent_loop.py (AgentLoopOutput, AgentLoopMetrics, and the batch
keys AgentLoopWorker._postprocess puts in the DataProto).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
from adapters_support import real_module, runs_of, trajectories

from rolloutd.client.adapters.verl import (
    VerlAgentLoopMetrics,
    VerlAgentLoopOutput,
    VerlBatch,
    to_verl_agent_loop_outputs,
    to_verl_batch,
)
from rolloutd.native_io.errors import ConfigError

AGENT_LOOP_OUTPUT_FIELDS = {
    "prompt_ids", "response_ids", "response_mask", "response_logprobs", "routed_experts", "multi_modal_data",
    "reward_score", "num_turns", "metrics", "extra_fields", "mm_processor_kwargs", "mm_processor_output",
}
AGENT_LOOP_METRICS_FIELDS = {"generate_sequences", "tool_calls", "compute_score", "num_preempted"}
BATCH_KEYS = {
    "prompts", "responses", "response_mask", "input_ids", "attention_mask", "position_ids",
    "rollout_log_probs", "rm_scores",
}
INT_KEYS = BATCH_KEYS - {"rollout_log_probs", "rm_scores"}


def test_plain_records_have_verls_fields_and_values() -> None:
    assert {f.name for f in dataclasses.fields(VerlAgentLoopOutput)} == AGENT_LOOP_OUTPUT_FIELDS
    assert {f.name for f in dataclasses.fields(VerlAgentLoopMetrics)} == AGENT_LOOP_METRICS_FIELDS
    trajs = trajectories()
    outs = to_verl_agent_loop_outputs(trajs, use_trainer_class=False)
    assert len(outs) == len(trajs)
    for t, o in zip(trajs, outs):
        assert isinstance(o, VerlAgentLoopOutput)
        assert o.prompt_ids == t.prompt_ids.tolist() and all(type(x) is int for x in o.prompt_ids)
        assert o.response_ids == t.response_ids.tolist()
        assert o.response_mask == t.response_mask.tolist()
        assert o.response_logprobs == t.response_logprobs.tolist()
        assert o.reward_score == t.reward
        # veRL counts the prompt and every assistant/tool message
        assert o.num_turns == 1 + len(runs_of(t))
        assert o.metrics.tool_calls == 1.25 and o.metrics.generate_sequences == 4.0 - 1.25
        assert o.metrics.compute_score == 1.5 and o.metrics.num_preempted == -1
        assert o.extra_fields["request_id"] == t.request_id
        assert o.extra_fields["weight_versions"] == t.weight_versions
    # a single-turn trajectory is 2 turns, as veRL's SingleTurnAgentLoop reports
    assert outs[1].num_turns == 2


def check_batch_arrays(batch: dict, trajs: list, as_numpy) -> None:
    arrays = {k: as_numpy(v) for k, v in batch.items()}
    assert set(arrays) == BATCH_KEYS
    n = len(trajs)
    p, r = arrays["prompts"].shape[1], arrays["responses"].shape[1]
    for k in ("prompts",):
        assert arrays[k].shape == (n, p)
    for k in ("responses", "response_mask", "rollout_log_probs", "rm_scores"):
        assert arrays[k].shape == (n, r), k
    for k in ("input_ids", "attention_mask", "position_ids"):
        assert arrays[k].shape == (n, p + r), k
    for k in INT_KEYS:
        assert arrays[k].dtype == np.int64, k
    assert arrays["rollout_log_probs"].dtype == np.float32 and arrays["rm_scores"].dtype == np.float32
    for i, t in enumerate(trajs):
        lp, lr = len(t.prompt_ids), len(t.response_ids)
        assert arrays["prompts"][i, p - lp :].tolist() == t.prompt_ids.tolist()  # left-padded
        assert arrays["responses"][i, :lr].tolist() == t.response_ids.tolist()  # right-padded
        assert arrays["response_mask"][i, :lr].tolist() == t.response_mask.tolist()
        assert arrays["response_mask"][i, lr:].sum() == 0
        lps = arrays["rollout_log_probs"][i]
        assert lps[:lr].tolist() == t.response_logprobs.tolist()
        assert (lps[arrays["response_mask"][i] == 0] == 0.0).all()
        expected_scores = np.zeros(r, np.float32)
        expected_scores[lr - 1] = t.reward
        assert arrays["rm_scores"][i].tolist() == expected_scores.tolist()
        assert arrays["attention_mask"][i].tolist() == [0] * (p - lp) + [1] * (lp + lr) + [0] * (r - lr)


def test_plain_batch_layout() -> None:
    trajs = trajectories()
    b = to_verl_batch(trajs, pad_token_id=3, use_trainer_class=False)
    assert isinstance(b, VerlBatch) and len(b) == len(trajs)
    check_batch_arrays(b.batch, trajs, np.asarray)
    assert (b.batch["prompts"][:, 0] == 3).sum() == 3  # every prompt but the longest starts with padding
    turns = b.non_tensor_batch["__num_turns__"]
    assert turns.dtype == np.int32 and turns.tolist() == [4, 2, 4, 1]
    assert b.non_tensor_batch["weight_versions"][0] == ["w0", "w1"]
    assert all(v.shape == (len(trajs),) for v in b.non_tensor_batch.values())
    timing = b.meta_info["timing"]
    assert timing["agent_loop/tool_calls/mean"] == 1.25
    assert timing["agent_loop/generate_sequences/max"] == 2.75


def test_fixed_lengths_and_torch_tensors() -> None:
    torch = real_module("torch")
    trajs = trajectories()
    b = to_verl_batch(trajs, prompt_length=8, response_length=16, tensor_type="torch", use_trainer_class=False)
    assert b.batch["prompts"].shape == (4, 8) and b.batch["responses"].shape == (4, 16)
    assert b.batch["input_ids"].dtype == torch.int64
    check_batch_arrays(b.batch, trajs, lambda x: x.numpy())
    with pytest.raises(ConfigError, match="prompt_length=4"):
        to_verl_batch(trajs, prompt_length=4, use_trainer_class=False)


def test_real_agent_loop_output_as_dict() -> None:
    mod = real_module("verl.experimental.agent_loop.agent_loop")
    torch = real_module("torch")
    assert AGENT_LOOP_OUTPUT_FIELDS <= set(mod.AgentLoopOutput.model_fields)
    assert set(mod.AgentLoopMetrics.model_fields) == AGENT_LOOP_METRICS_FIELDS
    # veRL's as_dict() writes the reward into the last response token: it cannot take an empty
    # response, so the error trajectory is left out here.
    trajs = [t for t in trajectories() if len(t.response_ids)]
    outs = to_verl_agent_loop_outputs(trajs, use_trainer_class=True)
    for t, o in zip(trajs, outs):
        assert isinstance(o, mod.AgentLoopOutput)
        d = o.as_dict()
        assert d["prompts"].dtype == torch.int64 and d["prompts"].tolist() == t.prompt_ids.tolist()
        assert d["responses"].tolist() == t.response_ids.tolist()
        assert d["response_mask"].tolist() == t.response_mask.tolist()
        assert d["rollout_log_probs"].dtype == torch.float32
        assert d["rollout_log_probs"].tolist() == t.response_logprobs.tolist()
        assert d["rm_scores"][-1].item() == t.reward and d["rm_scores"][:-1].abs().sum().item() == 0
        assert d["num_turns"] == 1 + len(runs_of(t))


def word_tokenizer():
    """A real fast tokenizer (no download): one word per id, pad id 0."""
    tokenizers = real_module("tokenizers")
    transformers = real_module("transformers")
    vocab = {"<pad>": 0, **{f"w{i}": i for i in range(1, 128)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>")


def test_padding_matches_verls_own_postprocess() -> None:
    mod = real_module("verl.experimental.agent_loop.agent_loop")
    trajs = trajectories()
    tok = word_tokenizer()
    worker = SimpleNamespace(tokenizer=tok)
    p_len, r_len = 9, 12
    ours = to_verl_batch(trajs, prompt_length=p_len, response_length=r_len, pad_token_id=tok.pad_token_id)
    for i, t in enumerate(trajs):
        # AgentLoopWorker._pad_token_ids only uses self.tokenizer: the exact padding veRL applies.
        pr = mod.AgentLoopWorker._pad_token_ids(
            worker, t.prompt_ids.tolist(), max_length=p_len, padding_side="left", return_attention_mask=True
        )
        rs = mod.AgentLoopWorker._pad_token_ids(
            worker, t.response_ids.tolist(), max_length=r_len, padding_side="right", return_attention_mask=True
        )
        assert ours.batch["prompts"][i].tolist() == pr["input_ids"][0].tolist()
        assert ours.batch["responses"][i].tolist() == rs["input_ids"][0].tolist()
        mask = [*pr["attention_mask"][0].tolist(), *rs["attention_mask"][0].tolist()]
        assert ours.batch["attention_mask"][i].tolist() == mask


def test_real_dataproto_batch() -> None:
    protocol = real_module("verl.protocol")
    model_utils = real_module("verl.utils.model")
    trajs = trajectories()
    b = to_verl_batch(trajs)
    assert isinstance(b, protocol.DataProto) and len(b) == len(trajs)
    check_batch_arrays(dict(b.batch.items()), trajs, lambda x: x.numpy())
    expected_pos = model_utils.compute_position_id_with_mask(b.batch["attention_mask"])
    assert b.batch["position_ids"].tolist() == expected_pos.tolist()
    assert b.non_tensor_batch["__num_turns__"].tolist() == [4, 2, 4, 1]
    # the batch behaves as veRL's own: split, concatenate, select
    halves = b.chunk(2)
    joined = protocol.DataProto.concat(halves)
    assert joined.batch["input_ids"].tolist() == b.batch["input_ids"].tolist()
    assert joined.non_tensor_batch["request_id"].tolist() == ["a", "b", "c", "d"]
    assert set(b.select(batch_keys=["responses"]).batch.keys()) == {"responses"}
    with pytest.raises(ConfigError):
        to_verl_batch(trajs, tensor_type="numpy", use_trainer_class=True)
