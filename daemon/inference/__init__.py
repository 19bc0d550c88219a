"""Inference backends (vLLM and SGLang over HTTP, vLLM in-process) and the server pool: token ids
in, token ids and one log-probability per generated token out, never re-encoded."""

from rolloutd.daemon.inference.base import GenerateResult, InferenceBackend, SamplingParams
from rolloutd.daemon.inference.factory import make_backend, parse_spec
from rolloutd.daemon.inference.pool import ServerPool

__all__ = ["GenerateResult", "InferenceBackend", "SamplingParams", "ServerPool", "make_backend", "parse_spec"]
