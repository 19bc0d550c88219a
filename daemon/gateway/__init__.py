"""The HTTP gateway (``rolloutd gateway``): the published rollout server's endpoints (``/process``,
``/cancel``, ``/status``, ``/add_llm_server``, ``/clear_llm_server``, ``/start``, ``/stop``) in front
of a node daemon or a router, for trainers written against that server.

Modules: ``mapping`` (an HTTP job <-> a rollout request and its trajectory, data sources),
``params`` (the published server's ``sampling_params`` in rolloutd's names), ``compat`` (the answer
as the published server's clients read it: ``messages``, ``critical_error``, ``filter``, ...),
``body`` (bounded, checked request bodies), ``auth`` (token, token in the URL, trusted networks,
the bind address), ``service`` (the gateway's state: running or not, the inference servers it
added, the pending jobs), ``server`` (the aiohttp app, error statuses, the command line). Nothing
is imported here.
"""
