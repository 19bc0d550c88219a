"""Padding and collation of trajectories into fixed-width arrays.

The layout is the one veRL's agent loop produces and most trainers accept: prompts padded on the
left (so every prompt ends at the same column and generation starts right after it), responses
padded on the right, ``input_ids`` = prompts ++ responses, an attention mask that is 0 exactly on
padding, and position ids counting real tokens from 0::

    prompts        | pad pad p0 p1 p2 |   responses   | r0 r1 r2 r3 pad |
    attention_mask |  0   0  1  1  1  |               |  1  1  1  1  0  |
    position_ids   |  0   0  0  1  2  |               |  3  4  5  6  6  |
    response_mask  |                  |               |  1  1  0  1  0  |

Ids and masks are int64 (torch's LongTensor), log-probabilities float32. Everything is built in
numpy; :meth:`PaddedBatch.as_tensors` hands out torch tensors sharing the same memory on request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal

import numpy as np

from rolloutd.client.adapters.common import TensorType, as_trajectory_list, masked_logprobs, tensors, trained_mask
from rolloutd.native_io.errors import ConfigError
from rolloutd.native_io.trajectory import Trajectory

Side = Literal["left", "right"]


def pad_sequences(
    sequences: Sequence[np.ndarray],
    *,
    side: Side,
    length: int | None = None,
    pad_value: float = 0,
    dtype: type[np.generic] = np.int64,
    length_name: str = "length",
) -> np.ndarray:
    """Stack 1-D sequences into ``[len(sequences), width]``, padding on ``side``.

    ``width`` is ``length`` when given (a trainer's fixed prompt or response length), else the
    longest sequence. A sequence longer than ``length`` is an error, never silently cut: cutting
    tokens would train on something the model did not see. ``length_name`` names the knob.
    """
    if side not in ("left", "right"):
        raise ConfigError(f"padding side must be 'left' or 'right', not {side!r}")
    lengths = [len(s) for s in sequences]
    longest = max(lengths, default=0)
    if length is None:
        width = longest
    elif longest > length:
        raise ConfigError(
            f"a sequence has {longest} tokens, more than {length_name}={length}; "
            f"raise {length_name} (or leave it unset to pad to the longest)"
        )
    else:
        width = length
    out = np.full((len(sequences), width), pad_value, dtype=dtype)
    for i, (seq, n) in enumerate(zip(sequences, lengths)):
        if n:
            if side == "left":
                out[i, width - n :] = seq
            else:
                out[i, :n] = seq
    return out


def length_mask(lengths: Sequence[int] | np.ndarray, width: int, *, side: Side) -> np.ndarray:
    """int64 ``[len(lengths), width]``: 1 on the real tokens of sequences padded on ``side``."""
    lens = np.asarray(lengths, dtype=np.int64)[:, None]
    cols = np.arange(width, dtype=np.int64)[None, :]
    real = cols >= width - lens if side == "left" else cols < lens
    return real.astype(np.int64)


def position_ids(attention_mask: np.ndarray) -> np.ndarray:
    """Positions that count only real tokens: ``max(cumsum(mask) - 1, 0)`` along the last axis.

    Padding before the first real token gets 0 and padding after the last repeats its position,
    which is what veRL computes (``verl/utils/model.py::compute_position_id_with_mask``).
    """
    return np.clip(np.cumsum(attention_mask, axis=-1, dtype=np.int64) - 1, 0, None)


def unpad(padded: np.ndarray, attention_mask: np.ndarray) -> list[np.ndarray]:
    """The rows of ``padded`` without their padding (where ``attention_mask`` is 0)."""
    return [row[m.astype(bool)] for row, m in zip(np.asarray(padded), np.asarray(attention_mask))]


@dataclass
class PaddedBatch:
    """Trajectories collated into fixed-width arrays (see the module docstring for the layout)."""

    prompts: np.ndarray
    """int64 ``[B, P]``, left-padded with the pad token."""
    responses: np.ndarray
    """int64 ``[B, R]``, right-padded with the pad token."""
    response_mask: np.ndarray
    """int64 ``[B, R]``: 1 on model tokens, 0 on observation tokens and padding."""
    response_logprobs: np.ndarray
    """float32 ``[B, R]``: the server's log-probabilities, 0.0 on observations and padding."""
    input_ids: np.ndarray
    """int64 ``[B, P + R]``: prompts followed by responses."""
    attention_mask: np.ndarray
    """int64 ``[B, P + R]``: 0 exactly on padding."""
    position_ids: np.ndarray
    """int64 ``[B, P + R]``: see :func:`position_ids`."""
    prompt_lengths: np.ndarray
    """int64 ``[B]``: unpadded prompt lengths."""
    response_lengths: np.ndarray
    """int64 ``[B]``: unpadded response lengths."""

    def __len__(self) -> int:
        return int(self.prompts.shape[0])

    def arrays(self) -> dict[str, np.ndarray]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def as_tensors(self, tensor_type: TensorType = "torch") -> dict[str, Any]:
        return tensors(self.arrays(), tensor_type)


def collate(
    trajectories: Trajectory | Sequence[Trajectory],
    *,
    prompt_length: int | None = None,
    response_length: int | None = None,
    pad_token_id: int = 0,
) -> PaddedBatch:
    """Pad trajectories into a :class:`PaddedBatch`.

    ``prompt_length``/``response_length`` fix the widths (as a trainer's config does); unset, each
    is the longest in the batch.
    """
    trajs = as_trajectory_list(trajectories)
    prompts = pad_sequences(
        [t.prompt_ids for t in trajs], side="left", length=prompt_length, pad_value=pad_token_id,
        length_name="prompt_length",
    )
    resp_seqs = [t.response_ids for t in trajs]
    responses = pad_sequences(
        resp_seqs, side="right", length=response_length, pad_value=pad_token_id, length_name="response_length"
    )
    width = responses.shape[1]
    response_mask = pad_sequences([trained_mask(t) for t in trajs], side="right", length=width)
    logprobs = pad_sequences(
        [masked_logprobs(t) for t in trajs], side="right", length=width, pad_value=0.0, dtype=np.float32
    )
    prompt_lengths = np.array([len(t.prompt_ids) for t in trajs], dtype=np.int64)
    response_lengths = np.array([len(s) for s in resp_seqs], dtype=np.int64)
    attention_mask = np.concatenate(
        [
            length_mask(prompt_lengths, prompts.shape[1], side="left"),
            length_mask(response_lengths, width, side="right"),
        ],
        axis=1,
    )
    return PaddedBatch(
        prompts=prompts,
        responses=responses,
        response_mask=response_mask,
        response_logprobs=logprobs,
        input_ids=np.concatenate([prompts, responses], axis=1),
        attention_mask=attention_mask,
        position_ids=position_ids(attention_mask),
        prompt_lengths=prompt_lengths,
        response_lengths=response_lengths,
    )
