"""Helpers shared by the tests (and the benches that drive the same stacks): waits on a named
condition with a deadline, free TCP ports, processes that print READY."""
