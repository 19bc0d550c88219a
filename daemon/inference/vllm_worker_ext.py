"""A vLLM worker extension that loads new weights from disk or bytes on the CPU build.

Start the server with ``--worker-extension-cls rolloutd.daemon.inference.vllm_worker_ext.WeightReload``
(or ``AsyncEngineArgs(worker_extension_cls=...)`` in process); a trainer then pushes weights with
``POST /collective_rpc {"method": "reload_from_path", "kwargs": {"weights_path": FOLDER}}``
(:func:`rolloutd.daemon.inference.vllm_weights.push_weights` does the whole push).

Why an extension: vLLM 0.32's weight-transfer routes need CUDA (NCCL or CUDA IPC), and its plain
``reload_weights`` leaves a tied ``lm_head`` wrong on the CPU build. CPU linear layers keep only a
pre-packed copy of each weight; the tied head gets no tensor of its own on reload, so its packed
copy keeps the old embedding until it is packed again (shared/notes/vllm_cpu.md).

This module is imported inside vLLM's worker processes: it must import nothing but vLLM's own
dependencies.
"""

from __future__ import annotations

from typing import Any


class WeightReload:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    def reload_from_path(self, weights_path: str) -> None:
        """Load every tensor of the HF checkpoint in ``weights_path`` (a folder), in place."""
        self.reload_weights(weights_path=weights_path)  # type: ignore[attr-defined]
        self._repack_lm_head()

    def reload_from_bytes(self, blob: bytes) -> None:
        """Load the tensors of one safetensors blob (HF names; a subset of the model is fine)."""
        from safetensors.torch import load

        self.reload_weights(weights_iterator=list(load(blob).items()))  # type: ignore[attr-defined]
        self._repack_lm_head()

    def _repack_lm_head(self) -> None:
        model: Any = self.model_runner.get_model()  # type: ignore[attr-defined]
        head = getattr(model, "lm_head", None)
        method = getattr(head, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(head)
