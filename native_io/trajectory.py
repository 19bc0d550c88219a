"""The trajectory a trainer receives: token arrays exactly as the inference server produced them.

``response_ids`` interleaves model tokens (mask 1, with the server's log-probability) and
observation tokens (mask 0, log-probability 0.0). Nothing in it was decoded and re-encoded.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

FINISH_REASONS = frozenset({"completed", "max_turns", "max_tokens", "context_length", "timeout", "eval_timeout",
                            "cancelled", "special_token", "error"})
INFRA_KINDS = frozenset({"sandbox", "inference", "daemon"})
"""What ``ended_by`` names when infrastructure ended a trajectory: the daemon refills these."""
ENDED_BY = frozenset({"model", "client", "deadline", "request", "task", "agent"}) | INFRA_KINDS


@dataclass
class TurnRecord:
    """One model turn: where its generated tokens sit in ``response_ids`` and what made them."""

    start: int
    """Index in ``response_ids`` of the turn's first generated token."""
    end: int
    """One past the turn's last generated token (``response_mask[start:end]`` is all 1)."""
    weight_version: str
    """The weights that produced this turn: the newest of ``weight_spans`` where the server reports
    per-token versions (vLLM >= 0.32), else the version the turn was sent under."""
    finish_reason: str
    """The server's finish reason for the turn: ``stop``, ``length`` or ``abort``."""
    server: str = ""
    """Address of the inference server that produced the turn."""
    sent_version: str = ""
    """The weight version set on the pool when the turn was sent."""
    weight_spans: list[tuple[str, int, int]] = field(default_factory=list)
    """``(version, start, end)`` runs of the turn's tokens under one version, counted from the
    turn's first token, as the server reported them; empty where it reports none."""
    straddled: bool = False
    """The turn's tokens may come from more than one weight version: the server reported several
    spans, or (reporting none) the version was changed while the turn was generated. A trainer
    that needs on-policy tokens drops or reweights such a turn."""

    def __post_init__(self) -> None:
        self.weight_spans = [(str(v), int(a), int(b)) for v, a, b in self.weight_spans]  # lists after the wire


@dataclass
class ToolStats:
    count: int = 0
    errors: int = 0
    total_s: float = 0.0
    max_s: float = 0.0

    def add(self, duration_s: float, ok: bool) -> None:
        self.count += 1
        self.errors += 0 if ok else 1
        self.total_s += duration_s
        self.max_s = max(self.max_s, duration_s)


@dataclass
class Trajectory:
    request_id: str
    sample_index: int
    task_id: str
    prompt_ids: np.ndarray
    """int32, the chat-templated prompt (system + task), encoded once."""
    response_ids: np.ndarray
    """int32, model and observation tokens after the prompt, in order."""
    response_mask: np.ndarray
    """uint8, 1 where the model generated the token, 0 for observation/template tokens."""
    response_logprobs: np.ndarray
    """float32, the server's log-probability of each model token; 0.0 where the mask is 0."""
    reward: float
    finish_reason: str
    """``completed``, ``max_turns``, ``max_tokens``, ``context_length`` (the model's outcomes), or
    ``timeout`` (a stage's deadline), ``eval_timeout`` (the tests' deadline), ``cancelled``,
    ``special_token`` (see ``content_special_tokens``), ``error``."""
    num_turns: int
    turns: list[TurnRecord] = field(default_factory=list)
    error_code: str | None = None
    error_message: str | None = None
    stage_s: dict[str, float] = field(default_factory=dict)
    """Seconds spent in each stage (``init``, ``run``, ``eval``)."""
    queued_s: float = 0.0
    """Seconds spent waiting for stage slots (not counted against time-outs)."""
    tools: dict[str, ToolStats] = field(default_factory=dict)
    template_append_only: bool = True
    """False when the chat template re-rendered earlier turns differently (see ``segments``)."""
    segments: list[tuple[int, int]] = field(default_factory=list)
    """Ranges of ``response_ids`` that each extend one consistent token history; a single range
    unless the history was rewritten (black-box agents) or the template is not append-only."""
    agent: str = ""
    metrics: dict[str, Any] = field(default_factory=dict)
    ended_by: str = "model"
    """Who ended it: ``model`` (its reward is the model's: train on it), ``client`` (cancelled),
    ``deadline`` (a run or eval stage ran out of time: ``timeout``, ``eval_timeout``), or what
    failed: ``request`` (bad input), ``task`` (a broken task, e.g. its set-up failed), ``agent``
    (a bug in the agent), or infrastructure: ``sandbox``, ``inference``, ``daemon``. Anything but
    ``model`` has no valid reward (0.0 is not a score) and no trainable token (every adapter masks
    it: ``adapters.common.trained_mask``); the cause is in ``error_code`` / ``error_message``."""

    def __post_init__(self) -> None:
        if self.ended_by not in ENDED_BY:
            raise ValueError(f"trajectory {self.request_id}/{self.sample_index}: ended_by {self.ended_by!r} is "
                             f"not one of {sorted(ENDED_BY)}")
        n = len(self.response_ids)
        if len(self.response_mask) != n or len(self.response_logprobs) != n:
            raise ValueError(
                f"trajectory {self.request_id}/{self.sample_index}: response arrays differ in length "
                f"(ids {n}, mask {len(self.response_mask)}, logprobs {len(self.response_logprobs)})"
            )

    @property
    def reward_valid(self) -> bool:
        """The model ended this trajectory, so its reward may be trained on."""
        return self.ended_by == "model"

    @property
    def weight_versions(self) -> list[str]:
        return [t.weight_version for t in self.turns]

    @property
    def stage_spans(self) -> dict[str, tuple[float, float]]:
        """(enter, exit) of each stage it left, from ``metrics["stage_events"]`` (monotonic seconds,
        one clock node-wide); a stage entered again keeps its last span."""
        spans: dict[str, tuple[float, float]] = {}
        entered: dict[str, float] = {}
        for stage, kind, at in self.metrics.get("stage_events", []):
            if kind == "enter":
                entered[stage] = at
            elif stage in entered:
                spans[stage] = (entered[stage], at)
        return spans

    @property
    def num_model_tokens(self) -> int:
        return int(self.response_mask.sum())

    def scalar_fields(self) -> dict[str, Any]:
        """Everything except the arrays, as plain JSON-friendly values."""
        return {
            "request_id": self.request_id,
            "sample_index": self.sample_index,
            "task_id": self.task_id,
            "reward": self.reward,
            "finish_reason": self.finish_reason,
            "num_turns": self.num_turns,
            "turns": [vars(t) for t in self.turns],
            "error_code": self.error_code,
            "error_message": self.error_message,
            "stage_s": dict(self.stage_s),
            "queued_s": self.queued_s,
            "tools": {k: vars(v) for k, v in self.tools.items()},
            "template_append_only": self.template_append_only,
            "segments": [list(s) for s in self.segments],
            "agent": self.agent,
            "metrics": dict(self.metrics),
            "ended_by": self.ended_by,
        }

    @classmethod
    def from_parts(cls, scalars: dict[str, Any], arrays: dict[str, np.ndarray]) -> "Trajectory":
        s = dict(scalars)
        s["turns"] = [TurnRecord(**t) for t in s.get("turns", [])]
        s["tools"] = {k: ToolStats(**v) for k, v in s.get("tools", {}).items()}
        s["segments"] = [tuple(x) for x in s.get("segments", [])]
        return cls(**s, **arrays)

    ARRAY_FIELDS = ("prompt_ids", "response_ids", "response_mask", "response_logprobs")
    ARRAY_DTYPES = {
        "prompt_ids": np.int32,
        "response_ids": np.int32,
        "response_mask": np.uint8,
        "response_logprobs": np.float32,
    }

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in self.ARRAY_FIELDS}

    def copy(self) -> "Trajectory":
        """A trajectory that owns its arrays (shared-memory views become private copies)."""
        return dataclasses.replace(self, **{name: np.array(getattr(self, name)) for name in self.ARRAY_FIELDS})


RESPONSE_FIELDS = ("response_ids", "response_mask", "response_logprobs")


def pack_batch(trajectories: list[Trajectory]) -> tuple[list[dict[str, Any]], dict[str, np.ndarray]]:
    """Scalars per trajectory, and the arrays of all of them as one ragged batch: each field
    concatenated, plus ``prompt_offsets`` and ``response_offsets`` (len + 1), so a reply carries six
    arrays whatever the number of trajectories."""
    prompt_lens = [len(t.prompt_ids) for t in trajectories]
    response_lens = [len(t.response_ids) for t in trajectories]
    arrays = {
        "prompt_ids": _concat([t.prompt_ids for t in trajectories], np.int32),
        "prompt_offsets": np.concatenate([[0], np.cumsum(prompt_lens)]).astype(np.int64),
        "response_offsets": np.concatenate([[0], np.cumsum(response_lens)]).astype(np.int64),
    }
    for name in RESPONSE_FIELDS:
        arrays[name] = _concat([getattr(t, name) for t in trajectories], Trajectory.ARRAY_DTYPES[name])
    return [t.scalar_fields() for t in trajectories], arrays


def unpack_batch(scalars: list[dict[str, Any]], arrays: dict[str, np.ndarray]) -> list[Trajectory]:
    """Trajectories whose arrays are views into ``arrays`` (no copy)."""
    po, ro = arrays["prompt_offsets"], arrays["response_offsets"]
    if len(po) != len(scalars) + 1 or len(ro) != len(scalars) + 1:
        raise ValueError(f"batch offsets do not match {len(scalars)} trajectories")
    out = []
    for i, sc in enumerate(scalars):
        parts = {"prompt_ids": arrays["prompt_ids"][po[i]:po[i + 1]]}
        for name in RESPONSE_FIELDS:
            parts[name] = arrays[name][ro[i]:ro[i + 1]]
        out.append(Trajectory.from_parts(sc, parts))
    return out


def _concat(parts: list[np.ndarray], dtype: Any) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)
