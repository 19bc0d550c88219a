"""The ``script`` agent: runs a fixed list of shell commands, no model involved.

For benches and tests of the pipeline itself (stage overlap, time-outs, cancellation), and for
set-ups that need a sandbox to do known work. Its trajectories carry no tokens.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from rolloutd.native_io.trajectory import ToolStats

from .base import Agent, AgentContext, AgentOutcome, register_agent


@dataclass
class ScriptConfig:
    commands: list[str] = field(default_factory=list)
    """Shell commands run one after the other; a non-zero exit does not stop the list."""
    command_timeout_s: float | None = None
    """Per-command limit; None uses the sandbox's default."""


class ScriptAgent(Agent):
    name = "script"
    config_class = ScriptConfig

    async def run(self, ctx: AgentContext) -> AgentOutcome:
        stats = ToolStats()
        exit_codes = []
        for command in self.config.commands:
            t0 = time.monotonic()
            result = await ctx.run(command, timeout_s=self.config.command_timeout_s)
            stats.add(time.monotonic() - t0, result.exit_code == 0)
            exit_codes.append(result.exit_code)
        empty = np.zeros(0, dtype=np.int32)
        return AgentOutcome(prompt_ids=empty, response_ids=empty, response_mask=np.zeros(0, dtype=np.uint8),
                            response_logprobs=np.zeros(0, dtype=np.float32), finish_reason="completed",
                            num_turns=len(self.config.commands), tools={"bash": stats} if exit_codes else {},
                            submitted=True, metrics={"exit_codes": exit_codes})


register_agent(ScriptAgent.name, ScriptAgent)
