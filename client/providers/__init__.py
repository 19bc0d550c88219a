"""rolloutd as a sandbox provider for other tools (SWE-ReX); each module imports its tool, installed apart."""
