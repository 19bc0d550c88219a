"""Images described rather than named: a Dockerfile, a ``docker save`` archive or an OCI layout,
each built once by Apptainer into a sandbox folder cached under the hash of its content.

References (``SandboxSpec.image``):
- ``dockerfile:/abs/folder`` (its ``Dockerfile``, the folder the build context) or
  ``dockerfile:/abs/folder/Name.dockerfile``: converted with spython into a definition file whose
  base is an image already on this node, so the build needs no registry. ``FROM rolloutd/default``
  is the default image (its SIF: ``scripts/build-image --sif``); ``FROM name:tag`` is an archive
  imported earlier whose ``docker save`` listed that tag.
- ``docker-archive:/abs/file.tar`` (``docker save``) and ``oci:/abs/layout`` (an OCI image layout
  folder of one image): unpacked by Apptainer, offline.

Builds run as the calling user with ``--fakeroot`` (root inside, mapped onto that user and its
``/etc/subuid`` range: ``scripts/add-sandbox-user`` gives the sandbox user one), so a Dockerfile's
``RUN`` never holds host privileges; files the build makes belong to that user, who can then write
them in a sandbox as an agent in Docker would. Each failure is an ImageError naming its step.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import pwd
import re
import shutil
import tarfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rolloutd.native_io.errors import ImageError
from rolloutd.native_io.output import LOG_TAIL_CHARS, tail

log = logging.getLogger(__name__)

PREFIXES = ("dockerfile:", "docker-archive:", "oci:")
DEFAULT_BASE = "rolloutd/default"
BUILD_TIMEOUT_S = 900.0
"""One ``apptainer build`` (a Dockerfile's RUN steps included); ROLLOUTD_IMAGE_BUILD_TIMEOUT_S raises it."""
FROM_LINE = re.compile(r"^\s*FROM\s", re.IGNORECASE | re.MULTILINE)
NAMES_FOLDER = "names"
"""Under the build cache: ``<name>`` -> the hash of an imported archive that listed that tag."""


@dataclass(frozen=True)
class BuildPlan:
    """What one build makes: the source Apptainer reads, a definition file (Dockerfiles only),
    the folder it runs in, and the content hash that names the result."""

    kind: str
    source: str
    definition: str | None
    cwd: Path
    key: str
    tags: tuple[str, ...] = ()


def is_built_reference(image: str) -> bool:
    return image.startswith(PREFIXES)


def build_root(cache: Path) -> Path:
    """Where built images live: ``images/built`` in the cache, made by ``scripts/build-image``
    sticky and world-writable so that each daemon's sandbox user can add its own builds."""
    return cache / "images" / "built"


async def resolve_built_image(image: str, cache: Path, default_sif: Callable[[], Awaitable[Path]]) -> Path:
    """The sandbox folder of a ``dockerfile:``/``docker-archive:``/``oci:`` reference, built first
    when its content hash is not cached. ``default_sif``: the default image's SIF (built if need
    be), for ``FROM rolloutd/default``."""
    root = build_root(cache)
    if image.startswith("dockerfile:"):
        dockerfile, recipes = await asyncio.to_thread(_parse_dockerfile, image)
        name = next(iter(recipes.values())).fromHeader or ""
        if name in (DEFAULT_BASE, f"{DEFAULT_BASE}:latest"):
            try:
                base = await default_sif()
            except ImageError as e:
                raise ImageError(f"image {image}: step 'resolve base image': FROM {name} needs the default image's "
                                 f"SIF, made as root by `scripts/build-image --sif` (part of `make image`): {e}") from e
        else:
            base = _imported_base(image, name, root)
        plan = await asyncio.to_thread(_plan_dockerfile, dockerfile, recipes, base)
    else:
        plan = await asyncio.to_thread(_plan_archive, image)
    target = root / plan.key
    if (target / ".complete").is_file():
        return target / "sandbox"
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock_file = open(root / f"{plan.key}.lock", "a+")
    except OSError as e:
        raise ImageError(f"image {image}: step 'cache': cannot write the build cache {root}: {e}; make it writable "
                         f"for this user (scripts/build-image makes it sticky and world-writable) or set "
                         f"ROLLOUTD_CACHE_DIR") from e
    with lock_file:
        # Another worker may be building the same content: wait for it instead of building twice.
        await asyncio.to_thread(fcntl.flock, lock_file, fcntl.LOCK_EX)
        if not (target / ".complete").is_file():
            await _build(image, plan, target)
    return target / "sandbox"


def _plan_archive(image: str) -> BuildPlan:
    kind, _, rest = image.partition(":")
    if kind == "docker-archive":
        path = Path(rest)
        if not path.is_absolute() or not path.is_file():
            raise ImageError(f"image {image}: step 'read archive': {path} is not a file on this node (give an "
                             "absolute path to a `docker save` tar)")
        tags = _archive_tags(image, path)
        return BuildPlan(kind, f"docker-archive:{path}", None, path.parent, _file_hash(kind, path), tags)
    path = Path(rest)
    if not path.is_absolute() or not (path / "index.json").is_file() or not (path / "oci-layout").is_file():
        raise ImageError(f"image {image}: step 'read OCI layout': {path} is not an OCI image layout folder "
                         "(index.json and oci-layout missing)")
    index = (path / "index.json").read_bytes()
    try:
        manifests = json.loads(index)["manifests"]
    except (ValueError, KeyError, TypeError) as e:
        raise ImageError(f"image {image}: step 'read OCI layout': its index.json is not an OCI index: {e}") from e
    if not isinstance(manifests, list) or len(manifests) != 1:
        # Apptainer's oci: source takes no reference: it builds a layout of one image.
        raise ImageError(f"image {image}: step 'read OCI layout': index.json must list exactly one manifest "
                         f"(it lists {len(manifests) if isinstance(manifests, list) else manifests!r})")
    digest = hashlib.sha256(f"{kind}\0".encode() + index)
    return BuildPlan(kind, f"oci:{path}", None, path, digest.hexdigest()[:24])


def _parse_dockerfile(image: str) -> tuple[Path, dict[str, Any]]:
    from spython.main.parse.parsers import DockerParser  # lazily: spython probes binaries at import

    given = Path(image.partition(":")[2])
    dockerfile = given / "Dockerfile" if given.is_dir() else given
    if not given.is_absolute() or not dockerfile.is_file():
        raise ImageError(f"image {image}: step 'read Dockerfile': no Dockerfile at {dockerfile} (give "
                         "dockerfile:/abs/folder or dockerfile:/abs/path/to/Dockerfile)")
    try:
        recipes = DockerParser(str(dockerfile)).recipe
    except Exception as e:  # spython raises bare exceptions on what it cannot parse
        raise ImageError(f"image {image}: step 'convert Dockerfile (spython)': {e}") from e
    # spython folds a second FROM into the first stage (measured, 0.3.14): count them here.
    stages = len(FROM_LINE.findall(dockerfile.read_text()))
    if len(recipes) != 1 or stages != 1 or any(r.layer_files for r in recipes.values()):
        raise ImageError(f"image {image}: step 'convert Dockerfile (spython)': {stages} FROM lines; only "
                         "single-stage Dockerfiles (no COPY --from) are built here")
    context = dockerfile.parent.resolve()
    for source, _ in next(iter(recipes.values())).files:
        resolved = (context / source).resolve()
        if not resolved.is_relative_to(context) or not resolved.exists():
            raise ImageError(f"image {image}: step 'convert Dockerfile (spython)': COPY source {source!r} is not "
                             f"in the build context {context}")
    return dockerfile, recipes


def _plan_dockerfile(dockerfile: Path, recipes: dict[str, Any], base: Path) -> BuildPlan:
    from spython.main.parse.writers import SingularityWriter

    # spython writes a docker bootstrap of the FROM name; the base is local, so say so.
    definition = re.sub(r"\A(?:(?:Bootstrap|From|Stage):[^\n]*\n)+", "", SingularityWriter(recipes).convert())
    definition = f"Bootstrap: localimage\nFrom: {base}\n" + definition
    digest = hashlib.sha256(f"dockerfile\0{definition}\0".encode())
    base_stat = base.stat()
    digest.update(f"{base_stat.st_size}\0{base_stat.st_mtime_ns}\0".encode())
    digest.update(_tree_hash(dockerfile.parent).encode())
    return BuildPlan("dockerfile", str(dockerfile), definition, dockerfile.parent, digest.hexdigest()[:24])


def _imported_base(image: str, name: str, root: Path) -> Path:
    """The sandbox folder of an archive imported earlier whose tags named ``name``. Never a registry."""
    ref = root / NAMES_FOLDER / _name_file(name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest")
    if ref.is_file():
        folder = root / ref.read_text().strip() / "sandbox"
        if folder.is_dir():
            return folder
    raise ImageError(f"image {image}: step 'resolve base image': FROM {name!r} is not on this node; images build "
                     f"without network, from {DEFAULT_BASE} or from a `docker save` archive imported first "
                     "(image docker-archive:/abs/file.tar, whose tags become names FROM can use)")


def _name_file(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:24]


def _archive_tags(image: str, path: Path) -> tuple[str, ...]:
    try:
        with tarfile.open(path) as tar:
            member = tar.extractfile("manifest.json")
            manifest = json.load(member) if member else None
    except (tarfile.TarError, KeyError, OSError, ValueError) as e:
        raise ImageError(f"image {image}: step 'read archive': {path} is not a `docker save` archive "
                         f"(no readable manifest.json): {e}") from e
    if not isinstance(manifest, list) or not manifest:
        raise ImageError(f"image {image}: step 'read archive': manifest.json of {path} lists no image")
    return tuple(t for entry in manifest for t in (entry.get("RepoTags") or []) if isinstance(t, str))


def _file_hash(kind: str, path: Path) -> str:
    digest = hashlib.sha256(f"{kind}\0".encode())
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:24]


def _tree_hash(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(root).as_posix()}\0{path.stat().st_mode}\0".encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def _check_subordinate_ids(image: str) -> None:
    """``apptainer build --fakeroot`` needs the caller's range in /etc/subuid; say so before it fails
    with its own terse message."""
    user = pwd.getpwuid(os.getuid()).pw_name
    try:
        with open("/etc/subuid") as f:
            owners = {line.split(":", 1)[0] for line in f if ":" in line}
    except OSError:
        owners = set()
    if user not in owners and str(os.getuid()) not in owners:
        raise ImageError(f"image {image}: step 'apptainer build': user {user} has no subordinate id range in "
                         "/etc/subuid, which `apptainer build --fakeroot` needs (scripts/add-sandbox-user gives the "
                         "sandbox user one; a root node daemon builds images in its workers, as that user)")


async def _build(image: str, plan: BuildPlan, target: Path) -> None:
    _check_subordinate_ids(image)
    # A staging folder of its own: a failed build's files owned by subordinate ids may be beyond
    # this user's rmtree, and must not block the next try.
    staging = target.with_name(f"{target.name}.partial-{os.getpid()}-{time.monotonic_ns()}")
    staging.mkdir(parents=True)
    source = plan.source
    if plan.definition is not None:
        source = str(staging / "image.def")
        Path(source).write_text(plan.definition)
    argv = ["apptainer", "-q", "build", "--fakeroot", "--sandbox", str(staging / "sandbox"), source]
    timeout_s = float(os.environ.get("ROLLOUTD_IMAGE_BUILD_TIMEOUT_S", BUILD_TIMEOUT_S))
    log.info("building image %s (%s) into %s", image, plan.kind, target)
    # Apptainer's own cache (layers of archives) beside the builds: the user's home may be read-only.
    env = {**os.environ, "APPTAINER_CACHEDIR": str(target.parent / ".apptainer-cache")}
    proc = await asyncio.create_subprocess_exec(*argv, cwd=plan.cwd, env=env, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                                                start_new_session=True)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        await proc.wait()
        await asyncio.to_thread(shutil.rmtree, staging, ignore_errors=True)
        raise ImageError(f"image {image}: step 'apptainer build': over {timeout_s:.0f} s "
                         "(ROLLOUTD_IMAGE_BUILD_TIMEOUT_S raises the limit)") from None
    if proc.returncode != 0:
        await asyncio.to_thread(shutil.rmtree, staging, ignore_errors=True)
        raise ImageError(f"image {image}: step 'apptainer build' ({plan.kind}) failed with exit {proc.returncode}: "
                         f"{tail(out.decode(errors='replace').strip(), LOG_TAIL_CHARS)}")
    (staging / ".complete").write_text(json.dumps({"image": image, "kind": plan.kind, "tags": plan.tags}))
    staging.rename(target)
    for tag in plan.tags:
        names = target.parent / NAMES_FOLDER
        names.mkdir(exist_ok=True)
        (names / _name_file(tag)).write_text(target.name)
