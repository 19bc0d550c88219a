"""`echo hi` as a trainer sees it: our client -> the worker's link -> PTY, against the same PTY
driven in-process (the floor of our stack) and against HTTP+JSON servers over TCP loopback running
the same PTY session: (1) FastAPI on uvicorn with the PTY in the server process (the minimal
server), (2) the published HTTP rollout server's architecture: a FastAPI parent that hands each
job to a worker process through multiprocessing queues and waits for the result. All in one run,
on the `local` backend so only the transport differs.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from common import check_targets, print_table, standard_args, summary_ms, time_calls, write_json  # noqa: E402
from daemon_fixtures import node_daemon  # noqa: E402
from support.net import free_port  # noqa: E402

from rolloutd.client.sync_client import RolloutClient  # noqa: E402
from rolloutd.native_io.pty_session import PtySession, PtyShellConfig, default_shell_argv  # noqa: E402

BLOCK = 25
"""Calls of one path in a row before the next path's turn."""
WARMUP = 50

HTTP_SERVER = r'''
import asyncio, multiprocessing as mp, sys, tempfile, threading
from pathlib import Path
from fastapi import FastAPI
from pydantic import BaseModel
import uvicorn
import psutil
import uvloop
from rolloutd.native_io.pty_session import PtySession, PtyShellConfig, default_shell_argv

def new_session() -> PtySession:
    d = Path(tempfile.mkdtemp(prefix="rld-http-"))
    return PtySession(PtyShellConfig(argv=default_shell_argv(), command_dir_host=d, command_dir_shell=str(d)))

def child(jobs: mp.Queue, results: mp.Queue) -> None:
    async def serve() -> None:
        session = new_session()
        await session.start()
        loop = asyncio.get_running_loop()
        while True:
            job_id, command = await loop.run_in_executor(None, jobs.get)
            r = await session.run(command)
            results.put((job_id, {"exit_code": r.exit_code, "output": r.output, "duration_s": r.duration_s}))
    uvloop.run(serve())

class Run(BaseModel):
    command: str
    timeout_s: float = 60.0

app = FastAPI()
mode = sys.argv[2] if __name__ == "__main__" else ""
session = new_session()
waiting: dict[int, asyncio.Future] = {}
counter = iter(range(1 << 62))

@app.on_event("startup")
async def start() -> None:
    if mode == "inprocess":
        await session.start()
        return
    ctx = mp.get_context("spawn")  # a fork of a process with a running event loop is not safe
    jobs, results = ctx.Queue(), ctx.Queue()
    ctx.Process(target=child, args=(jobs, results), daemon=True).start()
    app.state.jobs = jobs
    loop = asyncio.get_running_loop()
    def collect() -> None:
        while True:
            job_id, result = results.get()
            loop.call_soon_threadsafe(waiting.pop(job_id).set_result, result)
    threading.Thread(target=collect, daemon=True).start()

@app.post("/run")
async def run(req: Run) -> dict:
    if mode == "inprocess":
        r = await session.run(req.command, timeout_s=req.timeout_s)
        return {"exit_code": r.exit_code, "output": r.output, "duration_s": r.duration_s}
    job_id = next(counter)
    fut = waiting[job_id] = asyncio.get_running_loop().create_future()
    app.state.jobs.put((job_id, req.command))
    return await fut

if __name__ == "__main__":
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", loop="uvloop")
'''


class DirectPty:
    """The same PTY session driven in-process on its own uvloop (the floor of our stack)."""

    def __init__(self) -> None:
        self.loop = uvloop.new_event_loop()
        d = Path(tempfile.mkdtemp(prefix="rld-direct-"))
        self.session = PtySession(PtyShellConfig(argv=default_shell_argv(), command_dir_host=d,
                                                 command_dir_shell=str(d)))
        self.loop.run_until_complete(self.session.start())

    def block(self, k: int) -> list[float]:
        async def go() -> list[float]:
            out = []
            for _ in range(k):
                t0 = time.perf_counter()
                await self.session.run("echo hi")
                out.append(time.perf_counter() - t0)
            return out

        return self.loop.run_until_complete(go())

    def close(self) -> None:
        self.loop.run_until_complete(self.session.close())
        self.loop.close()


@contextlib.contextmanager
def http_server(mode: str) -> Iterator[Callable[[], None]]:
    """One `echo hi` POST to a FastAPI server in ``mode`` (see HTTP_SERVER)."""
    port = free_port()
    script = Path(tempfile.mkdtemp(prefix="rld-http-")) / "http_server.py"
    script.write_text(HTTP_SERVER)  # a file, not -c: the spawned queue worker re-imports it
    proc = subprocess.Popen([sys.executable, "-W", "ignore", str(script), str(port), mode])
    try:
        deadline = time.monotonic() + 30
        conn = None
        while time.monotonic() < deadline:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
                conn.connect()
                break
            except OSError:
                time.sleep(0.1)
        assert conn is not None
        body = json.dumps({"command": "echo hi"})

        def call() -> None:
            conn.request("POST", "/run", body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = json.loads(resp.read())
            assert data["output"] == "hi\n"

        yield call
    finally:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.terminate()
        proc.wait()


def main() -> int:
    args = standard_args(__doc__.splitlines()[0]).parse_args()
    n = 500 if args.quick else 3000
    run_dir = Path(tempfile.mkdtemp(prefix="rld-cl-"))
    samples: dict[str, list[float]] = {}
    with contextlib.ExitStack() as stack:
        address = stack.enter_context(node_daemon(run_dir, "--backend", "local", "--workers",
                                                  str(os.cpu_count() or 2), "--warm", "2"))
        ours = stack.enter_context(stack.enter_context(RolloutClient(address)).open_sandbox(ipython=False))
        assert ours.info.get("link"), "the node offered no worker link to a client on its node"
        # The same command through the supervisor: the path without the link.
        via_node = stack.enter_context(stack.enter_context(RolloutClient(address, worker_links=False))
                                       .open_sandbox(ipython=False))
        direct = DirectPty()
        stack.callback(direct.close)
        paths: dict[str, Callable[[int], list[float]]] = {
            "client": lambda k: time_calls(lambda: ours.run("echo hi"), k, warmup=0),
            "client_via_node": lambda k: time_calls(lambda: via_node.run("echo hi"), k, warmup=0),
            "direct": direct.block,
            "http": functools.partial(time_calls, stack.enter_context(http_server("inprocess")), warmup=0),
            "http_queues": functools.partial(time_calls, stack.enter_context(http_server("queues")), warmup=0),
        }
        for measure in paths.values():
            measure(WARMUP)
        # Blocks of every path in turn, so drift in machine load (these machines are noisy) hits
        # every path alike.
        for _ in range(n // BLOCK):
            for name, measure in paths.items():
                samples.setdefault(name, []).extend(measure(BLOCK))
    s = {name: summary_ms(v) for name, v in samples.items()}
    ours_p50 = s["client"]["p50_ms"]
    labels = {
        "client": "RolloutClient -> worker link -> PTY (ours)",
        "client_via_node": "RolloutClient -> daemon -> worker -> PTY (no link)",
        "direct": "PTY session in-process (floor of our stack)",
        "http": "HTTP+JSON, FastAPI, PTY in the server process",
        "http_queues": "HTTP+JSON, FastAPI -> mp.Queue -> worker process",
    }
    rows = [[labels[k], v["p50_ms"], v["p99_ms"], v["p50_ms"] / ours_p50] for k, v in s.items()]
    print_table(f"`echo hi` round trip as a trainer sees it (n={n} each, in blocks of {BLOCK} in turn)",
                ["path", "p50 ms", "p99 ms", "x ours"], rows)
    results = {"client_p50_ms": ours_p50, "client_p99_ms": s["client"]["p99_ms"],
               "client_via_node_p50_ms": s["client_via_node"]["p50_ms"], "direct_p50_ms": s["direct"]["p50_ms"],
               "http_p50_ms": s["http"]["p50_ms"], "http_p99_ms": s["http"]["p99_ms"],
               "http_queues_p50_ms": s["http_queues"]["p50_ms"]}
    write_json(args.json, results)
    http, http_queues, floor = s["http"]["p50_ms"], s["http_queues"]["p50_ms"], s["direct"]["p50_ms"]
    ok = check_targets([
        (f"client_p50_ms {ours_p50:.3f} <= 2 x direct_p50_ms {floor:.3f}", ours_p50 <= 2 * floor),
        (f"http/client {http / ours_p50:.2f}x >= 3x (minimal server)", http >= 3 * ours_p50),
        (f"http-queues/client {http_queues / ours_p50:.2f}x >= 3x (published architecture)",
         http_queues >= 3 * ours_p50),
    ])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
