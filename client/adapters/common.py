"""What every trainer adapter shares: input normalisation, mask runs, lazy imports, tensor types.

Trainer packages are never imported when this package is imported: each adapter asks
:func:`trainer_module` at call time, so ``import rolloutd.client.adapters`` stays cheap in an
environment that has none of them.
"""

from __future__ import annotations

import dataclasses

import functools
import importlib
import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal, Protocol

import numpy as np

from rolloutd.client.history_segments import split_history_segments
from rolloutd.native_io.errors import BadRequest, ConfigError, MissingDependency
from rolloutd.native_io.trajectory import Trajectory

logger = logging.getLogger(__name__)

TensorType = Literal["numpy", "torch"]
"""What the padded arrays are returned as: numpy arrays, or torch tensors sharing their memory."""


class Decoder(Protocol):
    """Anything with a Hugging Face style ``decode`` (``transformers`` or ``tokenizers``)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def as_trajectory_list(trajectories: Trajectory | Sequence[Trajectory]) -> list[Trajectory]:
    """One trajectory or several, as a non-empty list; a trajectory whose history was rewritten
    (several segments from the OpenAI proxy) becomes one trajectory per segment, because a trainer
    must never condition a segment on tokens the model did not see with it."""
    items = [trajectories] if isinstance(trajectories, Trajectory) else list(trajectories)
    if not items:
        raise BadRequest("no trajectories to convert: pass at least one Trajectory")
    out = []
    for i, t in enumerate(items):
        if not isinstance(t, Trajectory):
            raise BadRequest(f"item {i} is a {type(t).__name__}, not a rolloutd Trajectory")
        segments = split_history_segments(t)
        if len(segments) == 1:
            out.append(t)
            continue
        for k, seg in enumerate(segments):
            out.append(dataclasses.replace(
                t, prompt_ids=seg.prompt_ids, response_ids=seg.response_ids, response_mask=seg.response_mask,
                response_logprobs=seg.response_logprobs, turns=seg.turns, num_turns=len(seg.turns),
                segments=[(0, len(seg.response_ids))], metrics={**t.metrics, "history_segment": k}))
    return out


def mask_runs(mask: np.ndarray) -> list[tuple[int, int, int]]:
    """Maximal runs of equal values in a 0/1 mask, as ``(start, end, value)`` with ``end`` exclusive."""
    m = np.asarray(mask).astype(np.int8, copy=False)
    if m.size == 0:
        return []
    bounds = np.flatnonzero(np.diff(m)) + 1
    starts = np.concatenate(([0], bounds))
    ends = np.concatenate((bounds, [m.size]))
    return [(int(s), int(e), int(m[s])) for s, e in zip(starts, ends)]


def trained_mask(trajectory: Trajectory) -> np.ndarray:
    """The loss mask every adapter uses (the one rule): the response mask, or all zeros for a
    trajectory the model did not end (``reward_valid`` False: cancelled, ``timeout``,
    ``eval_timeout``, an infrastructure or task error), so such an outcome never trains, neither
    as a reward of 0 nor through its tokens. Drop such samples before grouping
    (``RolloutResult.trainable``) where you can."""
    mask = np.asarray(trajectory.response_mask)
    return mask if trajectory.reward_valid else np.zeros_like(mask)


def turn_versions(trajectory: Trajectory) -> dict[str, list[Any]]:
    """What every adapter reports of the weights behind a trajectory: ``weight_versions`` (one
    per model turn) and ``straddled_turns`` (indices of turns whose tokens may come from more than
    one version, ``TurnRecord.straddled``), so a trainer can drop or reweight them."""
    return {"weight_versions": [t.weight_version for t in trajectory.turns],
            "straddled_turns": [i for i, t in enumerate(trajectory.turns) if t.straddled]}


def model_spans(mask: np.ndarray) -> list[tuple[int, int]]:
    """The ``(start, end)`` runs where the mask is 1: the tokens the model generated."""
    return [(s, e) for s, e, v in mask_runs(mask) if v]


def masked_logprobs(trajectory: Trajectory, mask: np.ndarray | None = None) -> np.ndarray:
    """float32 response log-probabilities with exactly 0.0 wherever ``mask`` (default
    :func:`trained_mask`) is 0.

    Trainers read a logprob on an observation token as if the model had sampled it, so the
    convention is enforced here rather than trusted.
    """
    lp = np.asarray(trajectory.response_logprobs, dtype=np.float32)
    return np.where((trained_mask(trajectory) if mask is None else mask) != 0, lp, np.float32(0.0))


def hit_token_limit(trajectory: Trajectory) -> bool:
    """True when the token budget, not the model, ended the trajectory (trainers' ``truncated``)."""
    last_turn_cut = bool(trajectory.turns) and trajectory.turns[-1].finish_reason == "length"
    return trajectory.finish_reason in ("max_tokens", "context_length") or last_turn_cut


@dataclass
class StageTimes:
    """Where a trajectory's wall time went, in seconds."""

    model_s: float
    """The run stage less the time in tools: waiting on the inference server, mostly."""
    tools_s: float
    eval_s: float


def stage_times(trajectory: Trajectory) -> StageTimes:
    tools_s = sum(t.total_s for t in trajectory.tools.values())
    return StageTimes(
        model_s=max(trajectory.stage_s.get("run", 0.0) - tools_s, 0.0),
        tools_s=tools_s,
        eval_s=trajectory.stage_s.get("eval", 0.0),
    )


def trainer_module(module: str, *, package: str, use_trainer_class: bool | None) -> ModuleType | None:
    """The trainer's module when it should and can be used, else None.

    ``use_trainer_class``: None uses the trainer's own classes when its package imports and falls
    back to plain records otherwise; True requires the package; False never imports it.
    """
    if use_trainer_class is False:
        return None
    mod, error = _import_quietly(module)
    if mod is not None:
        return mod
    if use_trainer_class:
        raise MissingDependency(
            f"{module} is not importable ({error}); install the trainer ({package}) in this "
            f"environment or pass use_trainer_class=False to get plain records"
        ) from _IMPORT_ERRORS[module]
    logger.info("%s not importable (%s); returning plain records with the same field names", module, error)
    return None


_IMPORT_ERRORS: dict[str, BaseException] = {}


@functools.cache
def _import_quietly(module: str) -> tuple[ModuleType | None, str]:
    # Trainer packages import slowly (several seconds for ray/verl), hence the cache. Their
    # import-time deprecation warnings are theirs, not ours: they must not fail a caller that
    # treats warnings as errors. Any exception counts as "not importable": a trainer release can
    # be broken on this Python (SkyRL 0.3.0 raises a pydantic error on 3.11), and that must not
    # break a conversion that can fall back to plain records.
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(module), ""
    except Exception as e:
        _IMPORT_ERRORS[module] = e
        return None, f"{type(e).__name__}: {e}"


def torch_module() -> ModuleType:
    mod, error = _import_quietly("torch")
    if mod is None:
        raise MissingDependency(
            f"torch is not importable ({error}); install it (pip install 'rolloutd[train]') or "
            f"ask for tensor_type='numpy'"
        ) from _IMPORT_ERRORS["torch"]
    return mod


def to_tensor(array: np.ndarray, tensor_type: TensorType) -> Any:
    """``array`` as the requested type; torch tensors share the numpy array's memory."""
    if tensor_type == "numpy":
        return array
    if tensor_type == "torch":
        return torch_module().from_numpy(np.ascontiguousarray(array))
    raise ConfigError(f"tensor_type must be 'numpy' or 'torch', not {tensor_type!r}")


def tensors(arrays: dict[str, np.ndarray], tensor_type: TensorType) -> dict[str, Any]:
    return {k: to_tensor(v, tensor_type) for k, v in arrays.items()}


def decode(tokenizer: Decoder | None, ids: np.ndarray) -> str:
    """The text of ``ids`` for display only; empty without a tokenizer (the ids are what counts)."""
    if tokenizer is None:
        return ""
    return tokenizer.decode([int(x) for x in ids], skip_special_tokens=False)
