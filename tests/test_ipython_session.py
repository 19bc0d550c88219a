"""IPython kernels inside sandboxes: execute, errors, interrupt, restart, ipc only."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import psutil
import pytest

from rolloutd.daemon.sandbox.base import SandboxBackend, SandboxSpec
from rolloutd.daemon.sandbox.pool import Lease, open_lease
from rolloutd.native_io.errors import CommandTimeout, KernelDied


@pytest.fixture
async def lease(backend: SandboxBackend) -> AsyncIterator[Lease]:
    lease = await open_lease(backend.create(SandboxSpec(ipython=True)))
    yield lease
    await lease.destroy()


async def test_execute_stdout_stderr_result(lease: Lease) -> None:
    r = await lease.ipython("import sys\nprint('out')\nprint('err', file=sys.stderr)\n6 * 7")
    assert (r.status, r.stdout, r.stderr, r.result) == ("ok", "out\n", "err\n", "42")


async def test_state_persists_between_cells(lease: Lease) -> None:
    await lease.ipython("counter = [1, 2]")
    assert (await lease.ipython("counter.append(3); len(counter)")).result == "3"


async def test_error_with_clean_traceback(lease: Lease) -> None:
    r = await lease.ipython("def f():\n    return 1 / 0\nf()")
    assert r.status == "error"
    assert r.error is not None and r.error["ename"] == "ZeroDivisionError"
    text = "\n".join(r.error["traceback"])
    assert "return 1 / 0" in text and "\x1b[" not in text


async def test_timeout_interrupts_and_keeps_state(lease: Lease) -> None:
    await lease.ipython("kept = 'yes'")
    with pytest.raises(CommandTimeout) as e:
        await lease.ipython("import time\nprint('started', flush=True)\ntime.sleep(30)", timeout_s=1.0)
    assert e.value.details["kernel_restarted"] is False
    assert (await lease.ipython("kept")).result == "'yes'"


async def test_kernel_ignoring_interrupt_is_restarted(lease: Lease) -> None:
    assert lease.kernel is not None
    await lease.ipython("kept = 1")
    code = "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True: time.sleep(0.01)"
    with pytest.raises(CommandTimeout) as e:
        await lease.ipython(code, timeout_s=0.5)
    assert e.value.details["kernel_restarted"] is True
    r = await lease.ipython("'kept' in dir()")
    assert r.result == "False" and lease.kernel.restarts == 1


async def test_dead_kernel_is_reported_and_restarted(lease: Lease) -> None:
    with pytest.raises(KernelDied):
        await lease.ipython("import os\nos._exit(3)", timeout_s=10)
    assert (await lease.ipython("1 + 1")).result == "2"


async def test_kernel_uses_ipc_only(lease: Lease) -> None:
    assert lease.kernel is not None and lease.kernel.pid is not None
    info = json.loads((lease.sandbox.run_dir / "kernel.json").read_text())
    assert info["transport"] == "ipc"
    assert (lease.sandbox.run_dir / "k-1").is_socket()
    tree = psutil.Process(lease.kernel.pid)
    procs = [tree, *tree.children(recursive=True)]
    for p in procs:
        assert p.net_connections(kind="inet") == [], f"{p.cmdline()} opened a TCP/UDP socket"


async def test_kernel_starts_without_debugger_and_jedi_but_cells_can_import_them(lease: Lease) -> None:
    loaded = await lease.ipython("import sys\nsorted(m for m in ('debugpy', 'jedi') if m in sys.modules)")
    assert loaded.result == "[]", "the kernel loaded debugpy or jedi at start-up"
    imported = await lease.ipython("import debugpy, jedi\n(debugpy.__name__, jedi.__name__)")
    assert (imported.status, imported.result) == ("ok", "('debugpy', 'jedi')"), imported.error
