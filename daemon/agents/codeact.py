"""The built-in CodeAct-style agent: bash, ipython, str_replace_editor and submit, one Hermes tool
call per model turn, token-in/token-out through a :class:`TokenLedger`.

One turn: generate from the ledger's ids (at most ``max_tokens_per_turn``, less when the context
has less room), append the ids as they are, decode them to parse the tool call, run it in the
sandbox, append the observation's tokens. How a trajectory ends:

- ``completed``: the model called submit (nothing is appended after that turn);
- ``max_turns``: the last allowed turn was not submit; its tool still runs (its effect counts for
  the evaluation) but its observation is not appended, as no model turn would read it;
- ``max_tokens``: a turn ran into ``max_context_tokens`` (the whole sequence), or the next
  observation would not fit; the turn's tool call is not run when the turn was cut by the context;
- ``context_length``: the same, where the server's context window (its ``max_model_len``,
  smaller than ``max_context_tokens``) is the limit, or the server refused the sequence as too
  long; every turn so far is kept, and a prompt past the window gives a trajectory of no turns;
- ``timeout``: the trajectory's deadline passed; ``cancelled``: the server aborted the turn (a
  weight update with pause mode ``abort``); the partial turn's tokens are kept;
- ``special_token``: an observation held an added token's text under
  ``content_special_tokens = "reject"``; it is not appended. A task whose instructions hold one
  fails instead (SPECIAL_TOKEN, ended by the task).

A turn cut by ``max_tokens_per_turn`` (finish ``length``) has no end-of-turn token; the ledger
closes it with one as a template token (mask 0) and the model is told its reply was cut off.
A reply with no tool call gets a *user* message asking for one (there is no call to answer);
a malformed call gets a *tool* message saying what was wrong.
"""

from __future__ import annotations

import re
import time

from rolloutd.native_io.errors import ContextLengthExceeded, OperationTimeout, SpecialTokenInContent, TaskError
from rolloutd.native_io.trajectory import ToolStats

from .base import Agent, AgentContext, AgentOutcome, register_agent
from .content_text import ContentText
from .tokens import TokenLedger
from .tools import Observation, ToolBox

SYSTEM_PROMPT = (
    "You are an autonomous software engineer. You work in a sandbox holding a copy of a repository "
    "and resolve the issue you are given by running commands, reading and editing files.\n"
    "In every reply, think briefly, then call exactly one tool. You see its result in the next "
    "message. Reproduce the problem, fix the source code, check the fix (run the tests), then call "
    "submit."
)
_INSTANCE_ID = re.compile(r"\S+")


def user_prompt(ctx: AgentContext) -> str:
    """The task message; its ``Task id:`` line is what scripted policies key on."""
    if not _INSTANCE_ID.fullmatch(ctx.instance_id):
        raise TaskError(f"instance id {ctx.instance_id!r} must be non-empty and contain no whitespace")
    return (f"Task id: {ctx.instance_id}\n"
            f"Repository root: {ctx.workdir} (your shell starts there)\n\n"
            "Resolve this issue by changing the repository's source code:\n\n"
            f"<issue>\n{ctx.problem_statement.strip()}\n</issue>")


class CpuMeter:
    """Accumulates this thread's CPU time over ``with`` blocks (no awaits inside them)."""

    def __init__(self) -> None:
        self.total_s = 0.0
        self._t0 = 0.0

    def __enter__(self) -> None:
        self._t0 = time.thread_time()

    def __exit__(self, *exc: object) -> None:
        self.total_s += time.thread_time() - self._t0


class CodeActAgent(Agent):
    name = "codeact"

    async def run(self, ctx: AgentContext) -> AgentOutcome:
        cfg = self.config
        cpu = CpuMeter()
        with cpu:
            toolbox = ToolBox(ctx, command_timeout_s=cfg.command_timeout_s,
                              observation_max_chars=cfg.observation_max_chars, tools=cfg.tools)
            base = [{"role": "system", "content": cfg.system_prompt or SYSTEM_PROMPT},
                    {"role": "user", "content": user_prompt(ctx)}]
            content = ContentText(ctx.tokenizer, cfg.content_special_tokens or ctx.content_special_tokens)
            ledger = TokenLedger(ctx.tokenizer, base, [s.schema() for s in toolbox.specs.values()],
                                 max_total_tokens=cfg.max_context_tokens, template_check=cfg.template_check,
                                 window=ctx.context_limit(), content=content)
        setup_cpu_s = cpu.total_s
        stats: dict[str, ToolStats] = {}
        per_turn: list[float] = []
        waits = {"generate_s": 0.0, "tool_s": 0.0}
        finish = "max_turns"
        for turn in range(cfg.max_turns):
            mark = cpu.total_s
            try:
                ended = await self._turn(ctx, ledger, toolbox, cpu, stats, waits, last=turn == cfg.max_turns - 1)
            except OperationTimeout:
                ended = "timeout"
            finally:
                per_turn.append(cpu.total_s - mark)
            if ended:
                finish = ended
                break
        mark = cpu.total_s
        with cpu:
            outcome = ledger.outcome(finish_reason=finish, tools=stats, submitted=finish == "completed")
        # Only the last iteration can end before its model turn (deadline, full context): drop it.
        outcome.metrics.update(
            agent_cpu_s=cpu.total_s, agent_setup_cpu_s=setup_cpu_s, agent_final_cpu_s=cpu.total_s - mark,
            agent_cpu_s_per_turn=per_turn[:outcome.num_turns], **waits,
            tool_schemas=[s.schema() for s in toolbox.specs.values()])  # what the template showed the model
        return outcome

    async def _turn(self, ctx: AgentContext, ledger: TokenLedger, toolbox: ToolBox, cpu: CpuMeter,
                    stats: dict[str, ToolStats], waits: dict[str, float], *, last: bool) -> str | None:
        """One model turn and its tool call; the finish reason when the trajectory ends here."""
        cfg = self.config
        room = ledger.room
        if room < 1:
            return ledger.full_reason
        t0 = time.monotonic()
        try:
            result = await ctx.generate(ledger.ids, max_tokens=min(cfg.max_tokens_per_turn, room))
        except ContextLengthExceeded:
            return "context_length"
        finally:
            waits["generate_s"] += time.monotonic() - t0
        with cpu:
            text = ledger.add_turn(result)
            if result.finish_reason == "abort":
                return "cancelled"
            if result.finish_reason == "length" and len(result.token_ids) >= room:
                return ledger.full_reason
            action = toolbox.parse(text)
            if isinstance(action, Observation) and result.finish_reason == "length":
                action.content = (f"Your reply was cut off after {len(result.token_ids)} tokens "
                                  f"(max_tokens_per_turn). {action.content}")
        if isinstance(action, Observation):
            observation = action
        elif action.name == "submit":
            stats.setdefault("submit", ToolStats()).add(0.0, True)
            return "completed"
        else:
            observation = await toolbox.execute(action)
            waits["tool_s"] += observation.duration_s
        stats.setdefault(observation.tool, ToolStats()).add(observation.duration_s, observation.ok)
        if last:
            return "max_turns"
        with cpu:
            try:
                if not ledger.add_message(observation.role, observation.content):
                    return ledger.full_reason
            except SpecialTokenInContent:
                return "special_token"
        return None


register_agent(CodeActAgent.name, CodeActAgent)
