"""The trainer's own policy for the filecalc tasks: a small Qwen2 model (transformers, float32,
CPU), its batched token log-probabilities, and the supervised warm start on oracle solves.

The agent the rollouts run is the built-in ``codeact`` agent offered only bash and submit, with a
one-line system prompt: the prompt is about 420 tokens, a model turn about 40. The demonstrations
are built by the agent's own token ledger; the loop checks on its first step that a real
trajectory's prompt ids equal the ones demonstrated here.
"""

from __future__ import annotations

import copy
import json
import math
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from rolloutd.daemon.agents.codeact import user_prompt
from rolloutd.daemon.agents.content_text import ContentText
from rolloutd.daemon.agents.tokens import TokenLedger
from rolloutd.daemon.inference.base import GenerateResult
from rolloutd.daemon.agents.toolcalls import BASH, SUBMIT
from rolloutd.daemon.policy.tiny_model import (
    ENDOFTEXT_ID,
    IM_END_ID,
    TOKENIZER_FILES,
    TinyModelSpec,
    build_tiny_model,
)
from rolloutd.daemon.policy.tokenizer import DEFAULT_TOKENIZER_DIR, load_tokenizer
from rolloutd.daemon.sandbox.base import WORKSPACE_INSIDE
from rolloutd.daemon.tasks.filecalc import oracle_replies, problem_statement

SYSTEM_PROMPT = "Solve the task in the shell, one tool call per reply, then call submit."
TOOLS = [BASH.name, SUBMIT.name]
NO_OUTPUT = "[no output]"
"""What the bash tool answers for a command that prints nothing (the oracle's redirect)."""


def agent_config(max_tokens_per_turn: int) -> dict[str, Any]:
    return {"tools": TOOLS, "system_prompt": SYSTEM_PROMPT, "max_turns": 3,
            "max_tokens_per_turn": max_tokens_per_turn, "max_context_tokens": 1024}


@dataclass
class Sequence:
    """One tokenized episode: what the model saw and what it should (or did) generate."""

    prompt: list[int]
    response: list[int]
    mask: np.ndarray
    """1 where the model generates the token (loss and log-probabilities go there only)."""


def _messages(record: dict[str, Any]) -> list[dict[str, str]]:
    ctx = SimpleNamespace(instance_id=record["instance_id"], workdir=WORKSPACE_INSIDE,
                          problem_statement=problem_statement(record))
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user_prompt(ctx)}]  # type: ignore[arg-type]


def _ledger(tokenizer: Any, record: dict[str, Any]) -> TokenLedger:
    """The agent's own token ledger for ``record``'s prompt (the ids it really sends)."""
    return TokenLedger(tokenizer, _messages(record), [BASH.schema(), SUBMIT.schema()], max_total_tokens=4096,
                       template_check="off", content=ContentText(tokenizer, "text"))


def prompt_ids(tokenizer: Any, record: dict[str, Any]) -> list[int]:
    return _ledger(tokenizer, record).prompt_ids.tolist()


def demonstration(tokenizer: Any, record: dict[str, Any]) -> Sequence:
    """The oracle's episode built by the agent's ledger: each reply's tokens and its end-of-turn
    token as the model would generate them (mask 1), the framing and the tool's answer (mask 0)."""
    ledger = _ledger(tokenizer, record)
    replies = oracle_replies(record)
    for i, reply in enumerate(replies):
        ids = np.array([*tokenizer.encode(reply, add_special_tokens=False), IM_END_ID], dtype=np.int32)
        ledger.add_turn(GenerateResult(token_ids=ids, logprobs=np.zeros(len(ids), dtype=np.float32),
                                       finish_reason="stop", weight_version="", server=""))
        if i + 1 < len(replies):
            ledger.add_message("tool", NO_OUTPUT)
    out = ledger.outcome(finish_reason="completed")
    return Sequence(out.prompt_ids.tolist(), out.response_ids.tolist(), out.response_mask.astype(np.uint8))


class Policy:
    """A Qwen2ForCausalLM the trainer updates, saved as the folder vLLM loads."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        # The daemon's loader: AutoTokenizer would pick the slow Qwen2 class, which splits text differently.
        self.tokenizer = load_tokenizer(model_dir)

    @classmethod
    def fresh(cls, dest: Path, spec: TinyModelSpec) -> "Policy":
        if not (dest / "config.json").exists():
            build_tiny_model(dest, spec)
        return cls(dest)

    def save(self, dest: Path) -> Path:
        """The weights and the tokenizer in ``dest``, readable by vLLM's workers."""
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self.model.save_pretrained(tmp, safe_serialization=True)
        for name in TOKENIZER_FILES:
            shutil.copy(DEFAULT_TOKENIZER_DIR / name, tmp / name)
        (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": [IM_END_ID, ENDOFTEXT_ID]}))
        for path in tmp.iterdir():
            path.chmod(0o644)
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
        return dest

    def logprobs(self, batch: list[Sequence]) -> list[torch.Tensor]:
        """Per sequence, log p of each response token given everything before it (all positions;
        pick the mask-1 ones), differentiable. Every filecalc prompt starts with the same system
        prompt and tool schemas (most of it): that shared prefix runs once, with gradients, and its
        keys and values are repeated for the batch; the rest is one right-padded pass."""
        rows = [s.prompt + s.response for s in batch]
        shared = min(len(s.prompt) for s in batch) - 1  # the last prompt token predicts the first response one
        for row in rows[1:]:
            shared = next((i for i in range(shared) if row[i] != rows[0][i]), shared)
        prefix = self.model(input_ids=torch.tensor([rows[0][:shared]]), use_cache=True)
        cache = prefix.cache
        cache.batch_repeat_interleave(len(rows))
        width = max(map(len, rows)) - shared
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        attention = torch.zeros(len(rows), shared + width, dtype=torch.long)
        attention[:, :shared] = 1
        for i, row in enumerate(rows):
            ids[i, :len(row) - shared] = torch.tensor(row[shared:])
            attention[i, shared:len(row)] = 1
        positions = torch.arange(shared, shared + width)[None].expand(len(rows), -1)
        logits = self.model(input_ids=ids, attention_mask=attention, position_ids=positions,
                            cache=cache).logits.float()
        out = []
        for i, s in enumerate(batch):
            start, end = len(s.prompt) - shared, len(s.prompt) - shared + len(s.response)
            lp = torch.log_softmax(logits[i, start - 1:end - 1], dim=-1)
            out.append(lp.gather(1, ids[i, start:end, None])[:, 0])
        return out


def oracle_probability(policy: Policy, demos: list[Sequence]) -> float:
    """Mean probability that sampling at temperature 1 reproduces a demonstration exactly (a lower
    bound on the reward there: any correct command scores)."""
    with torch.no_grad():
        values = [math.exp(float(lp[torch.from_numpy(d.mask.astype(bool))].sum()))
                  for i in range(0, len(demos), 8) for d, lp in zip(demos[i:i + 8], policy.logprobs(demos[i:i + 8]))]
    return float(np.mean(values))


@dataclass(frozen=True)
class Curriculum:
    """Which part of each prompt the warm start trains on. From a random start the model learns
    the reply's format first and then sits at a saddle for the word it must copy (the operator):
    attention is spread over the whole context, so the word reaches the reply weakly. On the
    prompt's last ``tail`` tokens (from "Write that number" on, and the reply's header) the copy
    forms within a few hundred steps at lr 1e-3 (not at 3e-3, nor on 64-token tails within 600
    steps, nor on whole prompts within 400: measured offline). Once the oracle probability there
    reaches ``tail_target`` (above a third, the most a reply can reach without copying: the copy
    has formed) or after ``tail_max_steps``, each step takes a random window up to the whole
    prompt; the copy carries over to the system prompt and tool schemas in front (RoPE: relative
    positions) and the format follows."""

    tail: int = 30
    tail_target: float = 0.4
    tail_max_steps: int = 600

    def window(self, on_tail: bool, full: int, rng: random.Random) -> int:
        return min(self.tail, full) if on_tail else rng.randint(min(self.tail, full), full)


HEAD = 3
"""Prompt tokens kept in front of a cut one (``<|im_start|>system\n``): the model attends to the
first token as to a sink; a cut prompt starting mid-sentence taught it a first token it never sees."""


def _crop(batch: list[Sequence], on_tail: bool, curriculum: Curriculum, rng: random.Random) -> list[Sequence]:
    """The batch with the middle of each prompt cut out, keeping the first HEAD tokens and a common
    tail; the cut lands where every prompt has the same token (the instance ids differ), so the
    batched pass still shares a prefix."""
    full = min(len(s.prompt) for s in batch) - HEAD
    for _ in range(100):
        n = curriculum.window(on_tail, full, rng)
        if n == full or len({s.prompt[-n] for s in batch}) == 1:
            return [Sequence(s.prompt[:HEAD] + s.prompt[-n:], s.response, s.mask) for s in batch]
    return batch


def supervised_warm_start(policy: Policy, demos: list[Sequence], probe: list[Sequence], *, target: float,
                          ceiling: float, lr: float, batch: int, max_steps: int, seed: int,
                          curriculum: Curriculum = Curriculum(), log: Any = print) -> dict[str, float]:
    """Cross-entropy on the demonstrations' mask-1 tokens (prompts cut by ``curriculum``) until
    the probe's oracle probability on whole prompts reaches ``target`` (kept low so RL has room),
    or ``max_steps``. A step that lands above ``ceiling`` is undone: the weights go back to the
    last check under the target."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(policy.model.parameters(), lr=lr, weight_decay=0.0)
    policy.model.train()
    tail_probe = _crop(probe, True, curriculum, rng)
    step, prob, on_tail, tail_steps = 0, oracle_probability(policy, probe), True, 0
    below = (copy.deepcopy(policy.model.state_dict()), step, prob)
    while prob < target and step < max_steps:
        # On windows the whole-prompt probability climbs in a few steps once the format carries
        # over (0.007 -> 0.63 within 5 steps here): checked after every step there.
        for _ in range(5 if on_tail else 1):
            step += 1
            chosen = _crop(rng.sample(demos, batch), on_tail, curriculum, rng)
            optimizer.zero_grad()
            lps = policy.logprobs(chosen)
            tokens = sum(int(d.mask.sum()) for d in chosen)
            loss = -sum(lp[torch.from_numpy(d.mask.astype(bool))].sum() for d, lp in zip(chosen, lps)) / tokens
            loss.backward()
            optimizer.step()
        tail_prob = oracle_probability(policy, tail_probe)
        if on_tail:
            on_tail = tail_prob < curriculum.tail_target and step < curriculum.tail_max_steps
            tail_steps = step
        # Only on whole prompts does the probability mean what the rollouts will see.
        prob = 0.0 if on_tail else oracle_probability(policy, probe)
        log(f"  sft step {step} ({'tail' if on_tail else 'windows'}): loss {loss.item():.3f}, P(oracle solve) "
            f"on the whole-prompt probe {prob:.3f} (tail probe {tail_prob:.3f})")
        if prob > ceiling:
            state, back, prob = below
            policy.model.load_state_dict(state)
            log(f"  sft: {step} steps overshot {ceiling}; back to step {back} (P(oracle solve) {prob:.3f})")
            step = back
            break
        if prob < target:
            below = (copy.deepcopy(policy.model.state_dict()), step, prob)
    policy.model.eval()
    return {"sft_steps": step, "sft_tail_steps": tail_steps, "sft_oracle_probability": round(prob, 4)}
