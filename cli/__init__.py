"""The ``rolloutd`` command: starts, stops and asks the daemons (``node``, ``router``), runs the
demo, the policy server and the gateway. It sits on top of both ``daemon`` (which it starts in its
own process) and ``client`` (through which it asks a running daemon), so neither of those needs
the other."""
