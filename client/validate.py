"""The invariants of a trajectory and of a batch, checked: what a trainer may rely on.

A trainer cannot see inside rolloutd; it trusts that each row is what the model generated, under
the weights it names, scored only when the model ended it. :func:`validate_trajectory` and
:func:`validate_batch` check that, and raise :class:`InvalidTrajectory` naming every broken rule.
The test suite runs them on every trajectory it produces (``tests/conftest.py``); a trainer can
call them on what it receives::

    from rolloutd.client.validate import validate_batch
    validate_batch(result.trajectories)
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable

import numpy as np

from rolloutd.native_io.errors import InvalidTrajectory

from rolloutd.native_io.trajectory import ENDED_BY, FINISH_REASONS, Trajectory

MODEL_FINISHES = frozenset({"completed", "max_turns", "max_tokens", "context_length"})
"""The finish reasons of a trajectory the model ended (``ended_by == "model"``)."""


def trajectory_problems(t: Trajectory) -> list[str]:
    """Every broken invariant of ``t``, in words; empty when it is sound."""
    problems = _array_problems(t)
    if problems:
        return problems  # the other checks index the arrays
    return [*_turn_problems(t), *_outcome_problems(t)]


def validate_trajectory(t: Trajectory) -> None:
    problems = trajectory_problems(t)
    if problems:
        raise InvalidTrajectory(f"trajectory {t.request_id}/{t.sample_index} ({t.task_id}): " + "; ".join(problems))


def validate_batch(trajectories: Iterable[Trajectory]) -> None:
    """Each trajectory, and the batch: no (request id, sample index) twice."""
    items = list(trajectories)
    problems = [f"{t.request_id}/{t.sample_index}: {p}" for t in items for p in trajectory_problems(t)]
    twice = [key for key, n in Counter((t.request_id, t.sample_index) for t in items).items() if n > 1]
    problems += [f"{rid}/{index} appears more than once" for rid, index in twice]
    if problems:
        raise InvalidTrajectory(f"{len(problems)} problem(s) in a batch of {len(items)}: " + "; ".join(problems))


def _array_problems(t: Trajectory) -> list[str]:
    arrays = {name: np.asarray(getattr(t, name)) for name in Trajectory.ARRAY_FIELDS}
    out = [f"{name} is not one-dimensional" for name, a in arrays.items() if a.ndim != 1]
    if out:
        return out
    n = len(arrays["response_ids"])
    if len(arrays["response_mask"]) != n or len(arrays["response_logprobs"]) != n:
        return [f"response arrays differ in length (ids {n}, mask {len(arrays['response_mask'])}, "
                f"logprobs {len(arrays['response_logprobs'])})"]
    mask, lp = arrays["response_mask"], arrays["response_logprobs"]
    if not np.isin(mask, (0, 1)).all():
        out.append("response_mask holds values other than 0 and 1")
    if (lp[mask == 0] != 0.0).any():
        out.append(f"{int((lp[mask == 0] != 0.0).sum())} log-probabilities on tokens the model did not generate "
                   "(mask 0)")
    model = lp[mask == 1]
    if model.size and not (np.isfinite(model).all() and model.max() <= 1e-6):
        out.append("log-probabilities under mask 1 that are not finite values <= 0")
    for name in ("prompt_ids", "response_ids"):
        ids = arrays[name]
        if ids.size and (not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0):
            out.append(f"{name} holds values that are not token ids")
    return out


def _turn_problems(t: Trajectory) -> list[str]:
    out = []
    n = len(t.response_ids)
    mask = np.asarray(t.response_mask)
    position = 0
    for i, turn in enumerate(t.turns):
        if not position <= turn.start <= turn.end <= n:
            out.append(f"turn {i} spans [{turn.start}, {turn.end}), not inside the response of {n} tokens after "
                       f"the previous turn")
            continue
        position = turn.end
        if not (mask[turn.start:turn.end] == 1).all():
            out.append(f"turn {i} [{turn.start}, {turn.end}) covers tokens with mask 0")
        if not turn.weight_version:
            out.append(f"turn {i} has no weight version")
        if turn.weight_spans:
            covered = 0
            for version, start, end in turn.weight_spans:
                if start != covered or end < start or not version:
                    break
                covered = end
            if covered != turn.end - turn.start:
                out.append(f"turn {i}: weight spans {turn.weight_spans} do not cover its "
                           f"{turn.end - turn.start} tokens in order")
            elif len({v for v, _, _ in turn.weight_spans}) > 1 and not turn.straddled:
                out.append(f"turn {i} holds tokens of several weight versions but is not marked straddled")
    in_turns = sum(turn.end - turn.start for turn in t.turns)
    if t.turns and in_turns != int(mask.sum()):
        out.append(f"{int(mask.sum())} model tokens (mask 1) but the turns hold {in_turns}")
    for start, end in t.segments:
        if not 0 <= start <= end <= n:
            out.append(f"segment [{start}, {end}) is not inside the response of {n} tokens")
    return out


def _outcome_problems(t: Trajectory) -> list[str]:
    out = []
    if t.finish_reason not in FINISH_REASONS:
        out.append(f"finish_reason {t.finish_reason!r} is not one of {sorted(FINISH_REASONS)}")
    if t.ended_by not in ENDED_BY:
        out.append(f"ended_by {t.ended_by!r} is not one of {sorted(ENDED_BY)}")
    if not math.isfinite(t.reward):
        out.append(f"reward {t.reward} is not a finite number")
    if t.reward_valid and t.finish_reason not in MODEL_FINISHES:
        out.append(f"finish_reason {t.finish_reason!r} is not the model's, yet ended_by is 'model' (its reward "
                   "would be trained on)")
    if not t.reward_valid and t.reward != 0.0:
        out.append(f"reward {t.reward} on a trajectory the model did not end (ended_by {t.ended_by!r}): only "
                   "model outcomes carry a reward")
    return out
