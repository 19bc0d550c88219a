"""The HTTP gateway (``rolloutd gateway``): the published rollout server's endpoints (``/process``,
``/cancel``, ``/status``, ``/add_llm_server``, ``/clear_llm_server``, ``/start``, ``/stop``) in front
of a node daemon or a router, for trainers written against that server.

Modules: ``mapping`` (an HTTP job <-> a rollout request and its trajectory), ``service`` (the
gateway's state: running or not, the inference servers it added, the pending jobs), ``server``
(the aiohttp app, bearer-token check, error statuses, the command line). Nothing is imported here.
"""
