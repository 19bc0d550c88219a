"""Real vLLM for the tests: the tiny model, a server of the session, and the trainer-side
recompute of log-probabilities with transformers on the same weights."""

from __future__ import annotations

import asyncio
import os
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from rolloutd.daemon.policy.tiny_model import Recompute, TinyModelSpec, ensure_tiny_model
from rolloutd.daemon.inference.vllm_server import vllm_python

__all__ = ["FIDELITY", "Recompute", "abort_until_done", "perturbed_copy", "tiny_model", "wait_running"]

REPO = Path(__file__).resolve().parent.parent
FIDELITY = 1e-5
"""Largest |logprob(vLLM) - logprob(transformers)| accepted, per generated token (float32)."""


T = TypeVar("T")
ABORT_LANDS_WITHIN_S = 60.0
"""How long a running call may go on after aborts start (a loaded node takes seconds to admit it)."""


async def abort_until_done(abort: Callable[[], Awaitable[None]], call: asyncio.Task[T]) -> T:
    """Aborts ``call`` on the engine and returns its result. An abort of an id the engine has not
    admitted yet is a no-op, and neither the HTTP server nor the engine says when it has admitted
    one, so the abort is sent again until the call ends: the first one the engine holds ends it."""
    deadline = asyncio.get_running_loop().time() + ABORT_LANDS_WITHIN_S
    while not call.done():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"the call did not end within {ABORT_LANDS_WITHIN_S} s of aborting it")
        await abort()
        await asyncio.wait({call}, timeout=0.2)
    return call.result()


RUNNING_WITHIN_S = 60.0
"""How long a submitted call may take to reach the server's running set on a loaded node."""


def _running(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:
        for line in answer.read().decode().splitlines():
            if line.startswith("vllm:num_requests_running"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{url}/metrics has no vllm:num_requests_running")


async def wait_running(url: str, call: asyncio.Task[object]) -> None:
    """Waits until the server at ``url`` is decoding a request (its Prometheus gauge) while
    ``call``, the one that should be running there, goes on. A call that ends first fails
    the wait at once, saying how it ended: the gauge would never rise for it."""
    deadline = asyncio.get_running_loop().time() + RUNNING_WITHIN_S
    while await asyncio.to_thread(_running, url) < 1:
        if call.done():
            outcome = call.exception() or call.result()
            raise AssertionError(f"the call ended before {url} was seen running it: {outcome!r}")
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError(f"{url} was not running the call within {RUNNING_WITHIN_S} s "
                               f"(the call is still pending)")
        await asyncio.sleep(0.05)


def tiny_model(spec: TinyModelSpec = TinyModelSpec()) -> Path:
    cache = Path(os.environ.get("ROLLOUTD_CACHE_DIR", REPO / ".cache"))
    return ensure_tiny_model(cache, spec, python=vllm_python())


def perturbed_copy(model_dir: Path, dest: Path, seed: int) -> Path:
    """The same model with every weight changed (a training step's worth and more)."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, dest, dirs_exist_ok=True)
    tensors = load_file(str(model_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    changed = {k: (v + 0.05 * torch.randn(v.shape, generator=gen)).contiguous() for k, v in tensors.items()}
    save_file(changed, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest
