"""Turning an image reference into something ``apptainer instance start`` can use.

- ``default``: the bundled Debian image (bash, git, python3, ipykernel, pytest), built once by
  ``build_default_image.sh`` and cached by the hash of its recipe.
- a SIF file or a sandbox folder: used as is, after a check that it exists.
- ``docker://...``: converted once to a SIF in the cache (through spython, off the event loop),
  which needs a reachable registry.
- ``dockerfile:``, ``docker-archive:``, ``oci:``: built offline by :mod:`image_build`.

As root without squashfuse a SIF must be extracted at every start; sandbox folders start in
~0.3 s, so the default image is a sandbox folder.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
from importlib import resources
from pathlib import Path

from rolloutd.native_io.errors import ImageError
from rolloutd.native_io.output import LOG_TAIL_CHARS, tail

from .image_build import is_built_reference, resolve_built_image

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    """``$ROLLOUTD_CACHE_DIR``, else ``$XDG_CACHE_HOME/rolloutd``, else ``~/.cache/rolloutd``."""
    explicit = os.environ.get("ROLLOUTD_CACHE_DIR")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) / "rolloutd" if xdg else Path.home() / ".cache" / "rolloutd"


def default_image_script() -> Path:
    return Path(str(resources.files("rolloutd.daemon.sandbox") / "build_default_image.sh"))


async def build_default_image(*, want_sif: bool = False, timeout_s: float = 900.0) -> Path:
    """Path of the default image's sandbox folder, building it first if it is not cached."""
    out_dir = cache_dir() / "images"
    argv = ["bash", str(default_image_script()), str(out_dir)] + (["--sif"] if want_sif else [])
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise ImageError(f"building the default image took over {timeout_s:.0f} s; see {out_dir}") from None
    if proc.returncode != 0:
        raise ImageError(
            "the default sandbox image is not built and could not be built here: "
            f"{tail(err.decode(errors='replace').strip(), LOG_TAIL_CHARS)}. Build it once as root with "
            "`scripts/build-image` (or `rolloutd image build`), or pass image=PATH to a SIF or "
            "sandbox folder, or set ROLLOUTD_CACHE_DIR to a cache that holds it."
        )
    return Path(out.decode().strip().splitlines()[-1])


def _check_local_image(path: Path) -> Path:
    if path.is_dir():
        if not (path / ".singularity.d").is_dir():
            raise ImageError(
                f"{path} is a folder but not an Apptainer sandbox (no .singularity.d); "
                f"build one with `apptainer build --sandbox OUT {path}`"
            )
        return path
    if path.is_file():
        return path
    raise ImageError(f"image {path} does not exist")


def _convert_docker(ref: str, target: Path) -> None:
    """Blocking: pull and convert with spython (runs in a worker thread)."""
    from spython.main import Client  # imported lazily: it probes the binary at import

    if shutil.which("singularity") is None:
        raise ImageError("spython needs a `singularity` command; link it to apptainer (scripts/install-apptainer does)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".partial.sif")
    try:
        result = Client.build(recipe=ref, image=str(tmp), sudo=False, force=True, quiet=True, return_result=True)
    except Exception as e:  # spython raises bare exceptions from its subprocess wrapper
        raise ImageError(f"cannot convert {ref}: {e}") from e
    if not tmp.exists():
        raise ImageError(f"cannot convert {ref} (is the registry reachable from this node?): {result}")
    tmp.rename(target)


async def default_sif() -> Path:
    """The default image as a SIF (a base unprivileged builds can read: the sandbox folder holds
    device nodes and root-only files that a ``--fakeroot`` build cannot copy)."""
    return (await build_default_image(want_sif=True)).parent / "image.sif"


_default_image: Path | None = None
"""The default image once resolved: checking its recipe's hash costs a bash, not worth paying
at every sandbox start."""


async def resolve_image(image: str) -> Path:
    global _default_image
    if image == "default":
        if _default_image is None or not (_default_image / ".singularity.d").is_dir():
            _default_image = await build_default_image()
        return _default_image
    if is_built_reference(image):
        return await resolve_built_image(image, cache_dir(), default_sif)
    if image.startswith("docker://"):
        digest = hashlib.sha256(image.encode()).hexdigest()[:16]
        target = cache_dir() / "images" / "docker" / f"{digest}.sif"
        if not target.exists():
            log.info("converting %s to %s (once)", image, target)
            await asyncio.to_thread(_convert_docker, image, target)
        return target
    return _check_local_image(Path(image).expanduser().resolve())
