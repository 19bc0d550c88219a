"""The node daemon's own process parts: the supervisor (public socket, dispatch, worker
watching), the worker processes, the node's configuration, its sandbox user, co-located inference
engines, the reaper of a dead daemon's sandboxes, and the node's side of federation
(``router_link``). Built on the runtime packages beside it (``sandbox``, ``sessions``,
``pipeline``, ...); never imports ``daemon.router`` or the client."""
