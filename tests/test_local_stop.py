"""Stopping many local sandboxes at once: every process goes, with scans of /proc shared between
the stops instead of two or more per sandbox (a node ending a thousand rollouts at once)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from rolloutd.daemon.sandbox import local
from rolloutd.daemon.sandbox.base import SandboxSpec
from rolloutd.daemon.sandbox.lease import open_lease
from rolloutd.native_io.procfs import live_processes

SANDBOXES = 24


async def test_concurrent_stops_share_their_scans_and_leave_nothing(short_tmp: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    backend = local.LocalBackend(short_tmp)
    leases = [await open_lease(backend.create(SandboxSpec(ipython=False))) for _ in range(SANDBOXES)]
    for lease in leases:
        await lease.run("sleep 300 & sleep 300 &")  # jobs the stop must find by their session
    sessions = {s for lease in leases for s in lease.sandbox.session_ids}
    scans = 0

    def counted() -> list:
        nonlocal scans
        scans += 1
        return live_processes()

    monkeypatch.setattr(local, "live_processes", counted)
    await asyncio.gather(*(lease.destroy() for lease in leases))
    assert not [p for p in live_processes() if p.session in sessions]
    assert all(lease.sandbox.stop_rung == "sigkill" for lease in leases)
    # Each stop needs a scan after its kills and a last one finding nothing: alone, 2 per sandbox.
    assert scans <= SANDBOXES // 2, scans
