"""Real vLLM for the tests: the tiny model, a server of the session, and the trainer-side
recompute of log-probabilities with transformers on the same weights."""

from __future__ import annotations

import os
from pathlib import Path

from rolloutd.daemon.inference.tiny_model import Recompute, TinyModelSpec, ensure_tiny_model
from rolloutd.daemon.inference.vllm_server import vllm_python

__all__ = ["FIDELITY", "Recompute", "perturbed_copy", "tiny_model"]

REPO = Path(__file__).resolve().parent.parent
FIDELITY = 1e-5
"""Largest |logprob(vLLM) - logprob(transformers)| accepted, per generated token (float32)."""


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
