"""A worker process: owns a warm pool of sandboxes and executes the requests the supervisor sends.

One uvloop per worker. Each request runs in its own task; a CANCEL cancels that task. Results
with arrays are written once into a shared-memory segment (or sent as raw frames when the
client is not on this node); only their descriptors travel through the supervisor.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import functools
import gc
import logging
import os
import pickle
import signal
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import uvloop

from rolloutd.daemon.node.answers import Answer, Handler, as_error, reply_frames, send_error
from rolloutd.daemon.node.client_links import ClientLinks
from rolloutd.daemon.node.config import NodeConfig
from rolloutd.daemon.node.sandbox_requests import SandboxRequests
from rolloutd.daemon.pipeline.rollout import PipelineLimits, RolloutPipeline
from rolloutd.daemon.sandbox.base import SandboxBackend, SandboxSpec
from rolloutd.daemon.sandbox.pool import WarmPool
from rolloutd.daemon.sandbox.select import make_backend
from rolloutd.native_io import framing, shm
from rolloutd.native_io.errors import Cancelled, ConfigError, DuplicateRequest, RolloutdError
from rolloutd.native_io.trajectory import pack_batch
from rolloutd.native_io.unix_link import UnixLink
from rolloutd.native_io.wire import (
    MakeArraysArgs,
    PINNED_OPS,
    MsgType,
    RolloutArgs,
    SleepArgs,
    parse_args,
)

log = logging.getLogger(__name__)


@dataclass
class ClientListener:
    """The listening socket the supervisor bound for this worker's client links."""

    sock: socket.socket
    path: Path
    allowed_uids: set[int]


class Worker:
    def __init__(self, config: NodeConfig, index: int, generation: int, state_dir: Path, link_fd: int,
                 shm_prefix: str, clients: ClientListener | None = None, shared_dir: Path | None = None) -> None:
        """``shm_prefix`` names this worker's shared-memory segments (the supervisor's scheme);
        ``clients``: the socket the supervisor bound for this worker's client links, if any;
        ``shared_dir``: the node's folder its sandboxes read (``SandboxBackend.shared_dir``)."""
        self.config = config
        self.index = index
        self.generation = generation
        self.state_dir = state_dir
        self.link_fd = link_fd
        self.link: UnixLink | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        """The running loop, once serving: asyncio.get_running_loop() costs a getpid(2) per call."""
        self.client_listener = clients
        self.supervisor_gone = False  # it died (its link closed, or DEATH_SIGNAL), not a stop it asked for
        self.client_links: ClientLinks | None = None
        self.backend: SandboxBackend = make_backend(config.backend, state_dir, shared_dir)
        self.default_spec = SandboxSpec(image=config.image, limits=config.sandbox_limits())
        self.pool = WarmPool(
            self.backend,
            warm_specs={self.default_spec: config.warm_sandboxes_per_worker} if config.warm_sandboxes_per_worker else {},
            max_age_s=config.sandbox_max_age_s,
            disk_check_interval_s=config.sandbox_disk_check_interval_s,
            start_kernels=config.warm_ipython,
        )
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.sandbox_requests = SandboxRequests(self.pool, self.default_spec, clients.path if clients else None,
                                                self.index)
        self.arena = shm.SegmentArena(shm_prefix)
        self.handlers: dict[str, Handler] = {
            **self.sandbox_requests.handlers(),
            "debug.make_arrays": _make_arrays,
            "rollout": self._rollout,
            "inference.add_server": self._inference_op,
            "inference.remove_server": self._inference_op,
            "inference.set_weight_version": self._inference_op,
            "inference.pause": self._inference_op,
            "inference.resume": self._inference_op,
            "debug.sleep": self._sleep,
        }
        self.pipeline: RolloutPipeline | None = None
        self.extra_stats: list[Callable[[], dict[str, Any]]] = []

    # --- plumbing --------------------------------------------------------------------------

    def send(self, msg_type: MsgType, header: dict[str, Any], buffers: list[Any] | None = None) -> None:
        self._to_supervisor(framing.encode(msg_type, header, buffers))

    def _to_supervisor(self, frames: list[Any]) -> None:
        assert self.link is not None
        if not self.link.closed:  # the supervisor is gone; PDEATHSIG stops us
            self.link.send(frames)

    async def _start_pipeline(self) -> None:
        from rolloutd.daemon.inference import ServerPool
        from rolloutd.daemon.policy.tokenizer import load_tokenizer

        cfg = self.config
        share = max(1, cfg.worker_count)
        # Node-wide stage limits are split between the workers (each runs its own pipeline).
        limits = PipelineLimits(init=-(-cfg.init_concurrency // share), run=-(-cfg.run_concurrency // share),
                                eval=-(-cfg.eval_concurrency // share), queue=-(-cfg.queue_limit // share))
        tokenizer = await asyncio.to_thread(load_tokenizer, cfg.tokenizer or None)
        inference = await ServerPool.create(cfg.inference_servers, keys=cfg.inference_server_keys,
                                            api_key=cfg.inference_api_key or None,
                                            weight_version=cfg.inference_weight_version,
                                            server_wait_s=cfg.inference_server_wait_s)
        self.pipeline = RolloutPipeline(sandboxes=self.pool, inference=inference, tokenizer=tokenizer, limits=limits,
                                        cache_dir=self.backend.shared_dir / "task-cache", image=cfg.image,
                                        content_special_tokens=cfg.content_special_tokens,
                                        sandbox_limits=self.default_spec.limits)
        self.extra_stats.append(lambda: {"pipeline": self.pipeline.stats() if self.pipeline else {}})

    async def serve(self) -> None:
        stopping = asyncio.Event()

        def supervisor_died() -> None:
            self.supervisor_gone = True
            stopping.set()

        self.loop = loop = asyncio.get_running_loop()
        self.link = UnixLink(socket.socket(fileno=self.link_fd), self._on_message, on_close=supervisor_died)
        await self.pool.start()
        await self._start_pipeline()
        _freeze_start_up()
        if self.client_listener is not None:
            self.client_links = ClientLinks(self.client_listener.sock, allowed_uids=self.client_listener.allowed_uids,
                                            config=self.config, start=self.start_request, cancel=self.cancel)
        self.send(MsgType.HELLO, {"index": self.index, "pid": os.getpid(), "generation": self.generation,
                                  "census": self.backend.census_kind})
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stopping.set)
        loop.add_signal_handler(DEATH_SIGNAL, supervisor_died)
        try:
            async with asyncio.TaskGroup() as tg:
                stats = tg.create_task(self._stats_loop())
                await stopping.wait()
                stats.cancel()
        finally:
            await self.shutdown()

    async def shutdown(self) -> None:
        if self.client_links is not None:
            self.client_links.shut_down(supervisor_died=self.supervisor_gone)
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), self.sandbox_requests.cancel_all(), return_exceptions=True)
        if self.pipeline is not None:
            await self.pipeline.inference.close()
        await self.pool.close()
        await self.backend.close()
        self.arena.close()
        if self.link is not None:
            self.link.close()

    def _on_message(self, frames: list[Any]) -> None:
        try:
            msg_type, header, buffers = framing.decode(
                frames, max_bytes=self.config.max_message_bytes,
                known_types=frozenset({MsgType.REQUEST, MsgType.CANCEL, MsgType.RELEASE, MsgType.CENSUS}),
            )
        except RolloutdError:
            log.exception("worker %d: undecodable message from the supervisor", self.index)
            return
        if msg_type == MsgType.RELEASE:
            self.arena.free(header.get("segments", []))
            return
        if msg_type == MsgType.CENSUS:
            self.pool.take_census(Counter(dict(zip(header.get("keys", []), header.get("counts", [])))))
            return
        rid = header.get("id", "")
        if msg_type == MsgType.CANCEL:
            self.cancel(rid)
            return
        self.start_request(rid, header, buffers, self._to_supervisor)

    def cancel(self, rid: str) -> None:
        task = self.tasks.get(rid)
        if task is not None:
            task.cancel(msg="cancelled by the client")
        else:
            self.sandbox_requests.cancel(rid)

    def start_request(self, rid: str, header: dict[str, Any], buffers: list[Any],
                      answer: Answer) -> None:
        """Run a request in its own task, or a shell command at once when its shell is free
        (``SandboxRequests.run_now``); its one answer goes to ``answer`` (supervisor or client link)."""
        if rid in self.tasks or rid in self.sandbox_requests:  # the same id from the supervisor and a client link
            send_error(answer, rid, DuplicateRequest(f"request {rid} is already running on worker {self.index}"))
            return
        assert self.loop is not None  # requests come from the links, which serve() opens
        if header.get("op") == "sandbox.run" and self.sandbox_requests.run_now(rid, header, answer):
            return
        task = self.loop.create_task(self._handle(rid, header, buffers, answer))
        self.tasks[rid] = task
        task.add_done_callback(functools.partial(self._finished, rid, answer))

    def _finished(self, rid: str, answer: Answer, task: asyncio.Task[None]) -> None:
        self.tasks.pop(rid, None)
        if task.cancelled():
            # Cancelled before its first step (the CANCEL came in the same read as the request):
            # _handle never ran, so the request's one answer is given here.
            send_error(answer, rid, Cancelled(f"request {rid} was cancelled before it started"))

    async def _handle(self, rid: str, header: dict[str, Any], buffers: list[Any],
                      answer: Answer) -> None:
        # Pinned ops are never re-dispatched anyway; a rollout is "started" only once a sample enters
        # its first stage, so rollouts still queued here are re-dispatched if this worker dies.
        if header.get("op") not in PINNED_OPS and header.get("op") != "rollout":
            self.send(MsgType.STARTED, {"id": rid})
        try:
            args = parse_args(header.get("op"), header.get("args"))
            result, arrays = await self.handlers[header["op"]](args, header)
            refs: list[framing.ArrayRef] = []
            bufs: list[Any] = []
            if arrays:
                if header.get("arrays") == "shm":
                    refs = self.arena.write(arrays)
                else:
                    refs, bufs = framing.arrays_to_frames(arrays)
            answer(reply_frames(rid, result, [r.to_wire() for r in refs], bufs))
        except (Exception, asyncio.CancelledError) as e:
            send_error(answer, rid, as_error(rid, e, self.index))

    async def _stats_loop(self) -> None:
        proc = psutil.Process()
        while True:
            self.arena.trim()
            if self.client_links is not None:
                self.client_links.forget_expired(time.monotonic())
            stats = {"pool": self.pool.stats(), "in_flight": len(self.tasks) + len(self.sandbox_requests),
                     "rss_bytes": proc.memory_info().rss, "pid": os.getpid(), "shm_arena": self.arena.stats()}
            if self.client_links is not None:
                stats["client_links"] = dict(self.client_links.counters)
            for extra in self.extra_stats:
                stats.update(extra())
            self.send(MsgType.STATS, {"index": self.index, "stats": stats})
            await asyncio.sleep(1.0)

    async def _rollout(self, args: RolloutArgs, header: dict[str, Any]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        assert self.pipeline is not None
        rid = header["id"]
        trajectories = await self.pipeline.run_request(rid, args, on_start=lambda: self.send(MsgType.STARTED, {"id": rid}))
        scalars, arrays = pack_batch(trajectories)
        return {"trajectories": scalars}, arrays

    async def _inference_op(self, args: Any, header: dict[str, Any]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        assert self.pipeline is not None
        return await apply_inference_op(self.pipeline.inference, header["op"], args), {}

    async def _sleep(self, args: SleepArgs, header: dict[str, Any]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        await asyncio.sleep(args.seconds)
        arrays = _synthetic_batch(args.n_tokens, 1) if args.n_tokens > 0 else {}
        return {"run_dir": str(self.config.run_path), "worker_pid": os.getpid()}, arrays


async def _make_arrays(args: MakeArraysArgs, header: dict[str, Any]) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    per = max(1, args.n_tokens // max(1, args.n_trajectories))
    arrays = _synthetic_batch(per, args.n_trajectories)
    result: dict[str, Any] = {"n_trajectories": args.n_trajectories, "tokens_each": per}
    if args.encoding == "msgpack":
        return {**result, "embedded": {k: v.tolist() for k, v in arrays.items()}}, {}
    if args.encoding == "pickle":
        return result, {"pickle": np.frombuffer(pickle.dumps(arrays, protocol=5), dtype=np.uint8)}
    return result, arrays


def _freeze_start_up() -> None:
    """What start-up made (modules, the tokenizer: ~95k objects) lives as long as the worker; a
    full collection scanned it all again (~50 ms of CPU, every sandbox's I/O on this worker
    waiting), so it goes where the collector no longer looks."""
    gc.collect()
    gc.freeze()


@functools.lru_cache(maxsize=4)
def _synthetic_batch(per: int, n: int) -> dict[str, np.ndarray]:
    """A finished-looking ragged batch, built once: the benches measure transfer, not generation.

    Same layout as rollout results: one concatenated array per field plus ``offsets`` (n + 1).
    """
    ids = np.concatenate([np.arange(per, dtype=np.int32) + i for i in range(n)])
    return {
        "response_ids": ids,
        "response_logprobs": np.full(per * n, -0.5, dtype=np.float32),
        "response_mask": np.ones(per * n, dtype=np.uint8),
        "offsets": np.arange(0, per * (n + 1), per, dtype=np.int64),
    }


async def apply_inference_op(pool: Any, op: str, args: Any) -> dict[str, Any]:
    """One of the node's broadcast inference ops on this worker's server pool."""
    if op == "inference.add_server":
        if args.address.startswith("vllm-inprocess:"):
            raise ConfigError("an in-process vLLM engine is given when the node starts "
                              "(--inference-server vllm-inprocess:MODEL), so that all workers share one")
        await pool.add_server(args.address, api_key=args.api_key or None)
    elif op == "inference.remove_server":
        await pool.remove_server(args.address)
    elif op == "inference.set_weight_version":
        await pool.set_weight_version(args.version)
    elif op == "inference.pause":
        await pool.pause_all(args.mode)
    else:
        await pool.resume_all()
    return {"servers": pool.status().get("servers", [])}


PR_SET_PDEATHSIG = 1
DEATH_SIGNAL = signal.SIGHUP
"""What the kernel sends a worker when its supervisor dies: not SIGTERM, which the supervisor
sends to stop it, so the worker can tell its clients which of the two happened."""


def _die_with_parent() -> None:
    """DEATH_SIGNAL when the supervisor dies, even by SIGKILL, so no worker outlives it."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError as e:
        log.warning("no C library to set PR_SET_PDEATHSIG (%s): this worker may outlive a killed supervisor, "
                    "whose `rolloutd node stop` still ends it", e)
        return
    if libc.prctl(PR_SET_PDEATHSIG, DEATH_SIGNAL) != 0:
        err = ctypes.get_errno()
        raise RolloutdError(f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)} (errno {err})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="rolloutd worker (started by the node supervisor)")
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--generation", type=int, required=True)
    p.add_argument("--link-fd", type=int, required=True, help="the supervisor's end of a socketpair")
    p.add_argument("--state-dir", type=Path, required=True)
    p.add_argument("--shared-dir", type=Path, help="the node's folder every sandbox reads (task templates)")
    p.add_argument("--shm-prefix", required=True, help="prefix of this worker's shared-memory segment names")
    p.add_argument("--client-fd", type=int, help="a listening Unix socket for client links (client_links.py)")
    p.add_argument("--client-path", type=Path, help="where that socket is bound (told to clients)")
    p.add_argument("--client-uids", default="", help="comma-separated uids allowed on client links")
    args = p.parse_args(argv)
    config = NodeConfig.from_json(os.environ.pop("ROLLOUTD_NODE_CONFIG_JSON"))  # sandboxes never inherit it
    logging.basicConfig(level=config.log_level, format=f"%(asctime)s w{args.index} %(levelname)s %(name)s: %(message)s")
    _die_with_parent()
    clients = None
    if args.client_fd is not None:
        clients = ClientListener(socket.socket(fileno=args.client_fd), args.client_path,
                                 {int(u) for u in args.client_uids.split(",") if u})
    worker = Worker(config, args.index, args.generation, args.state_dir, args.link_fd, args.shm_prefix, clients,
                    args.shared_dir)
    t0 = time.monotonic()
    uvloop.run(worker.serve())
    log.info("worker %d stopped after %.1f s", args.index, time.monotonic() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
