"""NeMo-RL adapter: message logs split by mask runs, and the rollout batch around them.

Conventions from NVIDIA-NeMo/RL 7ea279a: nemo_rl/data/interfaces.py (message_log entries are
{"role", "content", "token_ids"} dicts), nemo_rl/experience/rollouts.py (assistant messages add
"generation_logprobs"; the batch carries "total_reward" and "truncated"), and
nemo_rl/algorithms/grpo.py::add_grpo_token_loss_masks_and_generation_logprobs (a message is trained
on exactly when it is an assistant message with generation_logprobs). NeMo-RL is not on PyPI
(only a 0.0.0 placeholder), so the real-class test skips unless it was installed from source.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from adapters_support import real_module, runs_of, trajectories

from rolloutd.client.adapters.nemo_rl import message_log_arrays, to_nemo_rl_batch, to_nemo_rl_message_logs
from rolloutd.native_io.errors import BadRequest, MissingDependency

MESSAGE_KEYS = {"role", "content", "token_ids"}


def test_messages_follow_mask_runs() -> None:
    trajs = trajectories()
    logs = to_nemo_rl_message_logs(trajs)
    assert [[m["role"] for m in log] for log in logs] == [
        ["user", "assistant", "user", "assistant"],
        ["user", "assistant"],
        ["user", "user", "assistant", "user"],
        ["user"],
    ]
    for t, log in zip(trajs, logs):
        assert log[0]["token_ids"].tolist() == t.prompt_ids.tolist()
        for message, (start, end, value) in zip(log[1:], runs_of(t)):
            assert MESSAGE_KEYS <= set(message)
            assert message["content"] == ""
            assert message["token_ids"].dtype == np.int64
            assert message["token_ids"].tolist() == t.response_ids[start:end].tolist()
            if value:
                lp = message["generation_logprobs"]
                assert lp.dtype == np.float32 and lp.tolist() == t.response_logprobs[start:end].tolist()
            else:
                assert "generation_logprobs" not in message


def test_round_trip_through_message_log_arrays() -> None:
    for t, log in zip(trajectories(), to_nemo_rl_message_logs(trajectories())):
        back = message_log_arrays(log)
        for name in ("prompt_ids", "response_ids", "response_mask", "response_logprobs"):
            assert back[name].tolist() == getattr(t, name).tolist(), name
    with pytest.raises(BadRequest):
        message_log_arrays([])


def test_observation_role_and_decoded_content() -> None:
    tokenizers = real_module("tokenizers")
    vocab = {f"w{i}": i for i in range(128)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    t = trajectories()[0]
    (log,) = to_nemo_rl_message_logs(t, tokenizer=tok, observation_role="tool", prompt_role="system")
    assert [m["role"] for m in log] == ["system", "assistant", "tool", "assistant"]
    assert [m["content"] for m in log] == ["w11 w12 w13 w14 w15", "w21 w22 w23", "w31 w32", "w24 w25 w26 w27"]


def test_torch_tensors() -> None:
    torch = real_module("torch")
    log = to_nemo_rl_message_logs(trajectories()[0], tensor_type="torch")[0]
    assert log[1]["token_ids"].dtype == torch.int64
    assert log[1]["generation_logprobs"].dtype == torch.float32
    assert message_log_arrays(log)["response_ids"].tolist() == trajectories()[0].response_ids.tolist()


def test_batch_columns() -> None:
    trajs = trajectories()
    b = to_nemo_rl_batch(trajs, use_trainer_class=False)
    assert set(b) == {"message_log", "length", "total_reward", "truncated", "loss_multiplier", "idx", "straddled_turns"}
    assert b["length"].dtype == np.int64 and b["length"].tolist() == [14, 5, 13, 2]
    assert b["total_reward"].dtype == np.float32 and b["total_reward"].tolist() == [1.0, 0.5, -0.25, 0.0]
    assert b["truncated"].dtype == np.bool_ and b["truncated"].tolist() == [False, False, True, False]
    assert b["loss_multiplier"].tolist() == [1.0, 1.0, 1.0, 0.0]
    assert b["idx"].tolist() == [0, 1, 2, 3]
    # "length" is the total of the message token counts, as NeMo-RL's DatumSpec defines it
    assert [sum(len(m["token_ids"]) for m in log) for log in b["message_log"]] == b["length"].tolist()


def test_requiring_nemo_rl_without_it_says_how_to_fix() -> None:
    if importlib.util.find_spec("nemo_rl") is not None:
        pytest.skip("NeMo-RL is installed here")
    with pytest.raises(MissingDependency, match="use_trainer_class=False") as err:
        to_nemo_rl_batch(trajectories(), use_trainer_class=True)
    assert isinstance(err.value, ImportError) and err.value.code == "MISSING_DEPENDENCY"


def test_real_batched_data_dict_and_flattening() -> None:
    mod = real_module("nemo_rl.distributed.batched_data_dict")
    message_utils = real_module("nemo_rl.data.llm_message_utils")
    torch = real_module("torch")
    trajs = trajectories()
    b = to_nemo_rl_batch(trajs, use_trainer_class=True)
    assert isinstance(b, mod.BatchedDataDict)
    assert b["total_reward"].dtype == torch.float32 and b["message_log"][0][1]["token_ids"].dtype == torch.int64
    # NeMo-RL's own steps: mark assistant tokens as trained, then flatten and right-pad the logs.
    # nemo_rl.algorithms.grpo does not import on CPU with a current transformers, so its backfill of
    # zero generation_logprobs on non-assistant messages is done here, as it does it.
    message_utils.add_loss_mask_to_message_log(b["message_log"], roles_to_train_on=["assistant"])
    for log in b["message_log"]:
        for m in log:
            m.setdefault("generation_logprobs", torch.zeros_like(m["token_ids"], dtype=torch.float32))
    flat, lengths = message_utils.batched_message_log_to_flat_message(b["message_log"], pad_value_dict={"token_ids": 0})
    assert lengths.tolist() == b["length"].tolist()
    for i, t in enumerate(trajs):
        n = int(lengths[i])
        zeros = [0] * len(t.prompt_ids)
        assert flat["token_ids"][i, :n].tolist() == [*t.prompt_ids.tolist(), *t.response_ids.tolist()]
        assert flat["token_loss_mask"][i, :n].tolist() == [*zeros, *t.response_mask.tolist()]
        assert flat["generation_logprobs"][i, :n].tolist() == [*zeros, *t.response_logprobs.tolist()]
