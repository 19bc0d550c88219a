"""Split a trajectory whose token history was rewritten into histories a trainer can use alone.

A black-box agent (a harness behind rolloutd's OpenAI proxy) may rewrite its conversation: edit
or drop earlier messages, change a reply, start a second conversation. rolloutd never splices
such a history into the tokens the model saw; the proxy starts a new *segment* from a fresh
render instead. With the agent's default ``keep_segments="all"`` every segment is in the arrays:
``response_ids`` holds the first segment's response, then each later segment's own prompt
(mask 0) and response, and ``trajectory.segments`` gives each segment's range. Conditioning a
later segment's tokens on the earlier ones would be wrong (the model never saw them together),
so a trainer should train on :func:`split_history_segments` of such a trajectory, one sequence
per segment, rather than on the concatenation (``trajectory.template_append_only`` is False
then). Trajectories without rewrites come back as one segment, unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rolloutd.native_io.trajectory import TurnRecord


@dataclass
class HistorySegment:
    """One consistent token history: each generated token was sampled given exactly
    ``prompt_ids`` and the ``response_ids`` before it."""

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    response_mask: np.ndarray
    response_logprobs: np.ndarray
    turns: list[TurnRecord] = field(default_factory=list)
    """The segment's model turns, with ``start``/``end`` counted in this segment's ``response_ids``."""


def split_history_segments(trajectory: Any) -> list[HistorySegment]:
    """The segments of a :class:`~rolloutd.native_io.trajectory.Trajectory` (or an agent outcome),
    as views of its arrays (copy what you keep past ``client.release``)."""
    t = trajectory
    info = [s for s in (t.metrics or {}).get("history_segments", []) if s.get("in_arrays")]
    if len(info) < 2:
        return [HistorySegment(t.prompt_ids, t.response_ids, t.response_mask, t.response_logprobs, list(t.turns))]
    if len(info) != len(t.segments):
        raise ValueError(f"the trajectory lists {len(info)} history segments in its arrays but {len(t.segments)} "
                         "ranges in segments; it was not produced by rolloutd's OpenAI proxy as documented")
    out = []
    for k, ((start, end), seg) in enumerate(zip(t.segments, info)):
        own_prompt = 0 if k == 0 else int(seg["prompt_tokens"])
        body = start + own_prompt
        prompt = t.prompt_ids if k == 0 else t.response_ids[start:body]
        turns = [dataclasses.replace(r, start=r.start - body, end=r.end - body)
                 for r in t.turns if body <= r.start < end]
        out.append(HistorySegment(prompt, t.response_ids[body:end], t.response_mask[body:end],
                                  t.response_logprobs[body:end], turns))
    return out
