"""Scripted replies: the reference server follows a per-task plan instead of sampling.

A random tiny model cannot solve a coding task, so demos and end-to-end tests give the server a
plan per task: ``{"plans": {"<task id>": ["reply of turn 1", "reply of turn 2", ...]}}``. The
rolloutd agent writes a line ``Task id: <instance id>`` into the user message; a request whose
decoded prompt has such a line with a planned key gets the reply for its turn (turn index =
number of assistant turns opened in the prompt - 1, counted on the ids: a ``<|im_start|>`` token
followed by ``assistant``, so a tool that prints the text ``<|im_start|>assistant`` does not move
the plan on), encoded without special tokens and followed by ``<|im_end|>``. Every emitted token still carries the model's TRUE log-probability
given the full context, so the log-probability check holds for scripted trajectories too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence

from tokenizers import Tokenizer

from rolloutd.daemon.policy.tokenizer import SpecialIds
from rolloutd.native_io.errors import ConfigError

PAST_END_REPLY = "I have nothing more to do for this task."
_TASK_LINE = re.compile(r"^Task id: (\S+)[ \t]*$", re.MULTILINE)
_ASSISTANT_OPEN = "<|im_start|>assistant"


@dataclass(frozen=True)
class ScriptedPlans:
    plans: dict[str, list[str]]

    @classmethod
    def load(cls, path: str | Path) -> ScriptedPlans:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read scripted plans from {path}: {e}") from e
        plans = data.get("plans") if isinstance(data, dict) else None
        if not isinstance(plans, dict) or not all(
            isinstance(k, str) and isinstance(v, list) and all(isinstance(t, str) for t in v)
            for k, v in plans.items()
        ):
            raise ConfigError(f'{path} must hold {{"plans": {{"<task id>": ["reply", ...]}}}}')
        return cls(plans=dict(plans))

    def reply_for(self, prompt_text: str, turns: int | None = None) -> str | None:
        """The planned reply for this prompt, or None when no ``Task id:`` line has a plan.
        ``turns``: assistant turns the prompt opens (default: counted in the text)."""
        for match in _TASK_LINE.finditer(prompt_text):
            plan = self.plans.get(match.group(1))
            if plan is not None:
                turn = (prompt_text.count(_ASSISTANT_OPEN) if turns is None else turns) - 1
                return plan[turn] if 0 <= turn < len(plan) else PAST_END_REPLY
        return None


class ScriptedReplies:
    """Turns a prompt's ids into the forced reply tokens (None: sample normally)."""

    def __init__(self, plans: ScriptedPlans, tokenizer: Tokenizer, special: SpecialIds) -> None:
        self._plans = plans
        self._tok = tokenizer
        self._im_end = special.im_end
        self._im_start = special.im_start

    def _assistant_turns(self, prompt_ids: Sequence[int]) -> int:
        starts = [i for i, t in enumerate(prompt_ids) if t == self._im_start]
        return sum(self._tok.decode(list(prompt_ids[i + 1:i + 4])).startswith("assistant") for i in starts)

    def forced_tokens(self, prompt_ids: Sequence[int]) -> list[int] | None:
        text = self._tok.decode(list(prompt_ids), skip_special_tokens=False)
        reply = self._plans.reply_for(text, self._assistant_turns(prompt_ids))
        if reply is None:
            return None
        return self._tok.encode(reply, add_special_tokens=False).ids + [self._im_end]
