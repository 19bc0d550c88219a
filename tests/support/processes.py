"""Command-line processes of the project started for a test: up once they print READY."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def ready_process(argv: list[str], env: dict[str, str] | None = None) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``argv`` started with piped output; yields it and its first stdout line (its READY line,
    or what it printed instead: the caller checks it); killed if still running afterwards."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        yield proc, proc.stdout.readline().strip()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
