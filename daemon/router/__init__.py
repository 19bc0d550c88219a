"""The router process (``rolloutd router``): a ZeroMQ broker in front of many node daemons;
dispatch by free capacity, broadcasts to every node, heartbeats and requeue of a vanished node's
requests. Never imports ``daemon.node`` or the runtime packages: it only moves messages."""
