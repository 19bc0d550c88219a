"""Agents: the loop that turns a task into a trajectory inside a sandbox.

``base`` holds the contract with the pipeline (AgentContext, AgentConfig, AgentOutcome, the Agent
class and the registry by name); ``context`` the context over a sandbox lease and the inference
pool; ``tokens`` the token-in/token-out ledger; ``codeact`` the built-in agent with its tools
(``toolcalls``, ``tools``, ``editor``). The black-box agent, which runs any harness speaking the
OpenAI chat API through a per-rollout proxy, is built on these and lives with that proxy
(``rolloutd.daemon.openai_proxy.agent``).
"""

from rolloutd.daemon.agents.base import (
    Agent,
    AgentConfig,
    AgentContext,
    AgentOutcome,
    make_agent,
    register_agent,
    registered_agents,
)
from rolloutd.daemon.agents.codeact import CodeActAgent
from rolloutd.daemon.agents.context import SandboxAgentContext
from rolloutd.daemon.agents.script import ScriptAgent
from rolloutd.daemon.agents.tokens import TokenLedger

__all__ = ["Agent", "AgentConfig", "AgentContext", "AgentOutcome", "CodeActAgent",
           "SandboxAgentContext", "ScriptAgent", "TokenLedger", "make_agent", "register_agent", "registered_agents"]
