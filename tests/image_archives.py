"""A tiny image (the host's dash and the C library it links) written as a ``docker save`` archive
and as an OCI image layout, in the formats' own layouts (no Docker on these machines), for the
image-build tests; and a way to run a build as the sandbox user, whose subordinate ids let
``apptainer build --fakeroot`` run (root has none)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pwd
import subprocess
import sys
import tarfile
from pathlib import Path

SANDBOX_USER = "rolloutd-sandbox"
ROOTFS_FILES = {"bin/sh": "/bin/dash", "lib/x86_64-linux-gnu/libc.so.6": "/lib/x86_64-linux-gnu/libc.so.6",
                "lib64/ld-linux-x86-64.so.2": "/lib64/ld-linux-x86-64.so.2"}


def layer_tar() -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for inside, host in ROOTFS_FILES.items():
            tar.add(os.path.realpath(host), arcname=inside)
        for name, text in (("etc/passwd", "root:x:0:0:root:/root:/bin/sh\n"), ("etc/group", "root:x:0:\n"),
                           ("etc/tiny-release", "tiny 1\n")):
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(text), 0o644
            tar.addfile(info, io.BytesIO(text.encode()))
    return buf.getvalue()


def _config(layer: bytes) -> bytes:
    return json.dumps({"architecture": "amd64", "os": "linux", "config": {"Env": ["PATH=/bin"]},
                       "rootfs": {"type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(layer).hexdigest()}"]}}).encode()


def write_docker_archive(path: Path, tag: str) -> Path:
    layer = layer_tar()
    config = _config(layer)
    config_name = f"{hashlib.sha256(config).hexdigest()}.json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": [tag], "Layers": ["layer0/layer.tar"]}]).encode()
    with tarfile.open(path, "w") as tar:
        for name, data in (("layer0/layer.tar", layer), (config_name, config), ("manifest.json", manifest)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def write_oci_layout(folder: Path, ref: str) -> Path:
    blobs = folder / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def blob(data: bytes, media_type: str) -> dict[str, object]:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return {"mediaType": media_type, "digest": f"sha256:{digest}", "size": len(data)}

    layer = layer_tar()
    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": blob(_config(layer), "application/vnd.oci.image.config.v1+json"),
                           "layers": [blob(layer, "application/vnd.oci.image.layer.v1.tar")]}).encode()
    entry = {**blob(manifest, "application/vnd.oci.image.manifest.v1+json"),
             "annotations": {"org.opencontainers.image.ref.name": ref}}
    (folder / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [entry]}))
    (folder / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    return folder


def as_sandbox_user(argv: list[str], *, timeout_s: float, env: dict[str, str] | None = None,
                    ) -> subprocess.CompletedProcess[str]:
    user = pwd.getpwnam(SANDBOX_USER)
    return subprocess.run(["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", *argv],
                          capture_output=True, text=True, timeout=timeout_s, cwd="/",
                          env={**os.environ, "HOME": user.pw_dir, **(env or {})})


def resolve_as_sandbox_user(image: str, *, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """``resolve_image(image)`` in a process of the sandbox user: stdout is the image's path, or
    stderr ends with the ImageError."""
    code = ("import asyncio, sys\nfrom rolloutd.daemon.sandbox.images import resolve_image\n"
            "from rolloutd.native_io.errors import ImageError\n"
            "try:\n    print(asyncio.run(resolve_image(sys.argv[1])))\n"
            "except ImageError as e:\n    print(f'ImageError: {e}', file=sys.stderr)\n    sys.exit(3)\n")
    return as_sandbox_user([sys.executable, "-c", code, image], timeout_s=timeout_s)
