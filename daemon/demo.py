"""The main job (for now): a warm pool of sandboxes and a few commands through it, with latencies."""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

from .sandbox.base import SandboxSpec
from .sandbox.pool import WarmPool
from .sandbox.select import make_backend

log = logging.getLogger(__name__)


async def run_demo(args: argparse.Namespace) -> int:
    state = Path(tempfile.mkdtemp(prefix="rld-demo-"))
    backend = make_backend(args.backend, state)
    spec = SandboxSpec(ipython=True)
    pool = WarmPool(backend, warm_specs={spec: 2})
    t0 = time.perf_counter()
    await pool.start()
    try:
        await pool.wait_ready(300)
        print(f"warm pool ready ({backend.name}, 2 sandboxes) in {time.perf_counter() - t0:.2f} s")
        t1 = time.perf_counter()
        lease = await pool.lease(spec)
        print(f"lease: {(time.perf_counter() - t1) * 1e3:.2f} ms")
        for cmd in ["echo hi", "python3 -c 'print(6*7)'", "git --version", "ls /usr/bin | wc -l"]:
            r = await lease.run(cmd)
            print(f"  $ {cmd:<28} exit={r.exit_code}  {r.duration_s * 1e3:7.2f} ms  {r.output.strip()[:40]}")
        res = await lease.ipython("import sys; sys.version.split()[0]")
        print(f"  ipython: python {res.result}  {res.duration_s * 1e3:.2f} ms")
        await pool.release(lease)
    finally:
        await pool.close()
    return 0
