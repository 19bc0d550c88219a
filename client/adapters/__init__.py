"""Trainer adapters: rolloutd trajectories in the record and batch shapes each trainer consumes.

One module per trainer (``verl``, ``skyrl``, ``nemo_rl``, ``openrlhf``, ``trl``) plus ``batching``
(padding helpers) and ``rows`` (a dataset row's rollout request). Importing this package imports no
trainer: each adapter imports its trainer lazily, when called, and falls back to plain records with
the same field names when the trainer is absent. ``verl_agent_loop``, ``skyrl_generator`` and
``openrlhf_agent`` subclass the trainer's own base class, so they import it: trainer configs name
them directly.
"""

from rolloutd.client.adapters.batching import PaddedBatch, collate, length_mask, pad_sequences, position_ids, unpad
from rolloutd.client.adapters.nemo_rl import message_log_arrays, to_nemo_rl_batch, to_nemo_rl_message_logs
from rolloutd.client.adapters.openrlhf import to_openrlhf_agent_outputs, to_openrlhf_experience
from rolloutd.client.adapters.skyrl import to_skyrl_generator_output
from rolloutd.client.adapters.trl import TRLRolloutFunc, rolloutd_reward, to_trl_rollout
from rolloutd.client.adapters.verl import to_verl_agent_loop_outputs, to_verl_batch

__all__ = [
    "PaddedBatch",
    "TRLRolloutFunc",
    "collate",
    "length_mask",
    "message_log_arrays",
    "pad_sequences",
    "position_ids",
    "rolloutd_reward",
    "to_nemo_rl_batch",
    "to_nemo_rl_message_logs",
    "to_openrlhf_agent_outputs",
    "to_openrlhf_experience",
    "to_skyrl_generator_output",
    "to_trl_rollout",
    "to_verl_agent_loop_outputs",
    "to_verl_batch",
    "unpad",
]
