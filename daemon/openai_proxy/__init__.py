"""An OpenAI-compatible proxy for black-box agents: a harness that speaks the chat API gets a
per-rollout ``/v1/chat/completions`` (tools, streaming) and ``/v1/models`` on a Unix socket in
its sandbox, and one on Anthropic's Messages API or OpenAI's Responses API gets ``/v1/messages``
or ``/v1/responses``, while rolloutd keeps the token history the model really saw.

``protocol`` holds the chat wire shapes, ``anthropic_api`` and ``responses_api`` the other two
APIs as translations into a chat request and out of a chat completion, ``apis`` the table the
server serves them from, ``history`` the token bookkeeping (segments and history
rewrites), ``session`` one rollout's request handling, ``server`` the HTTP server on the socket,
``sandbox_forwarder`` the loopback relay run inside the sandbox, and ``agent`` the ``blackbox``
agent that runs a harness with it (built on ``rolloutd.daemon.agents``, which never imports back).
"""
