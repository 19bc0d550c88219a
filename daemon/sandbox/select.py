"""Choosing a sandbox backend by name."""

from __future__ import annotations

import logging
from pathlib import Path

from rolloutd.native_io.errors import ConfigError

from .apptainer import ApptainerBackend, apptainer_available
from .base import SandboxBackend
from .local import LocalBackend

log = logging.getLogger(__name__)


def make_backend(name: str, state_dir: Path, shared_dir: Path | None = None) -> SandboxBackend:
    """``apptainer``, ``local``, or ``auto`` (apptainer when installed, else local, said loudly).
    ``shared_dir``: see ``SandboxBackend.shared_dir``."""
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    if name == "apptainer" or (name == "auto" and apptainer_available()):
        return ApptainerBackend(state_dir, shared_dir=shared_dir)
    if name not in ("auto", "local"):
        raise ConfigError(f"unknown sandbox backend {name!r}; use 'apptainer', 'local' or 'auto'")
    if name == "auto":
        log.warning("apptainer is not installed: using the 'local' sandbox backend, which isolates nothing")
    return LocalBackend(state_dir, shared_dir=shared_dir)
