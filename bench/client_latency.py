"""`echo hi` as a trainer sees it: our client -> node daemon -> worker -> PTY, against the same PTY
driven in-process (the floor of our stack) and against HTTP+JSON servers over TCP loopback running
the same PTY session: (1) FastAPI on uvicorn with the PTY in the server process (the minimal
server), (2) the published HTTP rollout server's architecture: a FastAPI parent that hands each
job to a worker process through multiprocessing queues and waits for the result. All in one run,
on the `local` backend so only the transport differs.
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import tempfile
import time
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


def direct_samples(n: int) -> list[float]:
    async def go() -> list[float]:
        d = Path(tempfile.mkdtemp(prefix="rld-direct-"))
        s = PtySession(PtyShellConfig(argv=default_shell_argv(), command_dir_host=d, command_dir_shell=str(d)))
        await s.start()
        for _ in range(20):
            await s.run("echo hi")
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            await s.run("echo hi")
            out.append(time.perf_counter() - t0)
        await s.close()
        return out

    return uvloop.run(go())


def http_samples(n: int, mode: str) -> list[float]:
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

        return time_calls(call, n, warmup=20)
    finally:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.terminate()
        proc.wait()


def main() -> int:
    args = standard_args(__doc__.splitlines()[0]).parse_args()
    n = 500 if args.quick else 3000
    run_dir = Path(tempfile.mkdtemp(prefix="rld-cl-"))
    with node_daemon(run_dir, "--backend", "local", "--workers", str(os.cpu_count() or 2), "--warm", "1") as address:
        with RolloutClient(address) as client:
            sb = client.open_sandbox(ipython=False)
            ours = summary_ms(time_calls(lambda: sb.run("echo hi"), n, warmup=50))
            sb.close()
    direct = summary_ms(direct_samples(n))
    http = summary_ms(http_samples(n, "inprocess"))
    http_queues = summary_ms(http_samples(n, "queues"))
    rows = [
        ["RolloutClient -> daemon -> worker -> PTY (ours)", ours["p50_ms"], ours["p99_ms"], 1.0],
        ["PTY session in-process (floor of our stack)", direct["p50_ms"], direct["p99_ms"], direct["p50_ms"] / ours["p50_ms"]],
        ["HTTP+JSON, FastAPI, PTY in the server process", http["p50_ms"], http["p99_ms"], http["p50_ms"] / ours["p50_ms"]],
        ["HTTP+JSON, FastAPI -> mp.Queue -> worker process", http_queues["p50_ms"], http_queues["p99_ms"],
         http_queues["p50_ms"] / ours["p50_ms"]],
    ]
    print_table(f"`echo hi` round trip as a trainer sees it (n={n})", ["path", "p50 ms", "p99 ms", "x ours"], rows)
    results = {"client_p50_ms": ours["p50_ms"], "client_p99_ms": ours["p99_ms"], "direct_p50_ms": direct["p50_ms"],
               "http_p50_ms": http["p50_ms"], "http_p99_ms": http["p99_ms"],
               "http_queues_p50_ms": http_queues["p50_ms"]}
    write_json(args.json, results)
    ok = check_targets([
        (f"client_p50_ms {ours['p50_ms']:.3f} <= 1.0", ours["p50_ms"] <= 1.0),
        (f"http/client {http['p50_ms'] / ours['p50_ms']:.2f}x >= 3x (minimal server)", http["p50_ms"] >= 3 * ours["p50_ms"]),
        (f"http-queues/client {http_queues['p50_ms'] / ours['p50_ms']:.2f}x >= 3x (published architecture)",
         http_queues["p50_ms"] >= 3 * ours["p50_ms"]),
    ])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
