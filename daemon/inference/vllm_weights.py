"""Push new weights to a running vLLM server on the CPU, the way a trainer does between steps.

vLLM 0.32's weight-transfer routes need CUDA, so on the CPU build the push is a reload from disk
through rolloutd's worker extension (:mod:`rolloutd.daemon.inference.vllm_worker_ext`, which the
server must have been started with), then a reset of the prefix cache (blocks computed under the
old weights would otherwise be reused: max |diff| 0.66 seen without it) and the new version label,
which vLLM then reports per generated token. Pause the pool around the push (``pause_inference``)
to keep every turn on one version.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from rolloutd.native_io.errors import InferenceError

RELOAD_METHOD = "reload_from_path"


def _post(url: str, path: str, body: dict[str, Any], api_key: str | None, timeout_s: float) -> Any:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    request = urllib.request.Request(url.rstrip("/") + path, data=json.dumps(body).encode(), headers=headers,
                                     method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as e:
        detail = e.read()[:500].decode("utf-8", "replace")
        hint = (" (was the server started with --worker-extension-cls "
                "rolloutd.daemon.inference.vllm_worker_ext.WeightReload and VLLM_SERVER_DEV_MODE=1?)"
                if path == "/collective_rpc" else "")
        raise InferenceError(f"{url}{path} answered HTTP {e.code}: {detail}{hint}") from e
    except OSError as e:
        raise InferenceError(f"{url}{path} failed: {e}") from e
    return json.loads(raw) if raw.strip() else None


def push_weights(url: str, weights_dir: Path, version: str, *, api_key: str | None = None,
                 timeout_s: float = 120.0) -> None:
    """Load the HF checkpoint in ``weights_dir`` into the server at ``url`` and label it ``version``."""
    _post(url, "/collective_rpc", {"method": RELOAD_METHOD, "kwargs": {"weights_path": str(weights_dir)}},
          api_key, timeout_s)
    answer = _post(url, "/reset_prefix_cache", {}, api_key, timeout_s)
    if isinstance(answer, dict) and answer.get("success") is False:
        raise InferenceError(f"{url} did not reset its prefix cache after the weight push: {answer}")
    _post(url, "/update_weight_version", {"new_version": version}, api_key, timeout_s)
