"""Images from a Dockerfile, a ``docker save`` archive and an OCI layout, built by real Apptainer
without network (as the sandbox user, as in the daemon's workers), cached by content hash; bad
images fail with an error naming the step."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest

from image_archives import as_sandbox_user, resolve_as_sandbox_user, write_docker_archive, write_oci_layout
from rolloutd.daemon.sandbox import image_build
from rolloutd.daemon.sandbox.images import resolve_image
from rolloutd.native_io.errors import ImageError

pytestmark = pytest.mark.apptainer

BUILD_TIMEOUT_S = 300.0
"""One build from the default image's SIF: about 20 s here, more on a loaded machine."""
CACHED_RESOLVE_S = 5.0
SHOW = "show() { for f; do while IFS= read -r l; do echo \"$l\"; done < \"$f\"; done; }; show"
"""``cat`` in shell built-ins: the tiny image holds a shell and nothing else."""
"""A cached image is found by hashing its Dockerfile's folder: no build, well under this."""


@pytest.fixture
def context(short_tmp: Path) -> Path:
    """A folder the sandbox user can read (the builds run as that user; no socket lives here)."""
    short_tmp.chmod(0o755)
    return short_tmp


def _exec(image: str, command: str) -> str:
    r = as_sandbox_user(["apptainer", "-q", "exec", "--containall", image, "/bin/sh", "-c", command],
                        timeout_s=BUILD_TIMEOUT_S)
    assert r.returncode == 0, r.stderr
    return r.stdout


def _built(image: str) -> str:
    r = resolve_as_sandbox_user(image, timeout_s=BUILD_TIMEOUT_S)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.timeout(2 * BUILD_TIMEOUT_S)
def test_dockerfile_from_the_default_image_builds_once(context: Path) -> None:
    marker = uuid.uuid4().hex  # a Dockerfile no earlier run built
    (context / "notes.txt").write_text("from the context\n")
    (context / "Dockerfile").write_text(
        "FROM rolloutd/default\nENV GREETING=hi\nWORKDIR /app\nCOPY notes.txt /app/notes.txt\n"
        f"RUN echo {marker} > /app/marker && python3 -c 'import pytest'\n")
    path = _built(f"dockerfile:{context}")
    assert _exec(path, "cat /app/marker /app/notes.txt; echo $GREETING").split() == [
        marker, "from", "the", "context", "hi"]
    stamp = (Path(path).parent / ".complete").stat().st_mtime_ns
    t0 = time.monotonic()
    assert _built(f"dockerfile:{context}/Dockerfile") == path
    assert time.monotonic() - t0 < CACHED_RESOLVE_S
    assert (Path(path).parent / ".complete").stat().st_mtime_ns == stamp


def test_the_cache_key_is_the_content(context: Path) -> None:
    (context / "Dockerfile").write_text("FROM rolloutd/default\nCOPY a.txt /a.txt\n")
    (context / "a.txt").write_text("one")
    base = context / "base.sif"
    base.write_bytes(b"not read: only its size and time enter the key")

    def key() -> str:
        dockerfile, recipes = image_build._parse_dockerfile(f"dockerfile:{context}")
        return image_build._plan_dockerfile(dockerfile, recipes, base).key

    first = key()
    assert key() == first
    (context / "a.txt").write_text("two")
    assert key() != first
    (context / "a.txt").write_text("one")
    assert key() == first
    (context / "Dockerfile").write_text("FROM rolloutd/default\nCOPY a.txt /b.txt\n")
    assert key() != first


@pytest.mark.timeout(3 * BUILD_TIMEOUT_S)
def test_archive_and_oci_layout_build_offline_and_a_dockerfile_builds_on_the_archive(context: Path) -> None:
    tag = f"tiny-{uuid.uuid4().hex[:12]}:1"
    archive = write_docker_archive(context / "tiny.tar", tag)
    from_archive = _built(f"docker-archive:{archive}")
    assert _exec(from_archive, f"{SHOW} /etc/tiny-release") == "tiny 1\n"
    layout = write_oci_layout(context / "layout", "v1")
    from_layout = _built(f"oci:{layout}")
    assert _exec(from_layout, f"{SHOW} /etc/tiny-release") == "tiny 1\n" and from_layout != from_archive
    # The archive's tag is now a name a Dockerfile's FROM can use, offline.
    (context / "app").mkdir()
    (context / "app" / "Dockerfile").write_text(f"FROM {tag}\nRUN echo built-on-tiny > /built\n")
    derived = _built(f"dockerfile:{context}/app")
    assert _exec(derived, f"{SHOW} /built /etc/tiny-release") == "built-on-tiny\ntiny 1\n"
    # A RUN step that fails: the error names the build step and shows its output.
    (context / "bad").mkdir()
    (context / "bad" / "Dockerfile").write_text(f"FROM {tag}\nRUN echo about-to-fail && exit 7\n")
    cache = Path(derived).parent.parent
    before = set(cache.iterdir())
    r = resolve_as_sandbox_user(f"dockerfile:{context}/bad", timeout_s=BUILD_TIMEOUT_S)
    assert r.returncode == 3 and "step 'apptainer build'" in r.stderr and "about-to-fail" in r.stderr, r.stderr
    assert [p.name for p in set(cache.iterdir()) - before if not p.name.endswith(".lock")] == [], \
        "a failed build left its staging folder or a result"


@pytest.mark.parametrize("files, image, step", [
    ({}, "dockerfile:{c}", "read Dockerfile"),
    ({"Dockerfile": "FROM ubuntu:24.04\nRUN true\n"}, "dockerfile:{c}", "resolve base image"),
    ({"Dockerfile": "FROM rolloutd/default\nCOPY ../secret /x\n"}, "dockerfile:{c}", "convert Dockerfile"),
    ({"Dockerfile": "FROM rolloutd/default AS a\nRUN true\nFROM rolloutd/default\nCOPY --from=a /x /x\n"},
     "dockerfile:{c}", "convert Dockerfile"),
    ({"x.tar": "not a tar"}, "docker-archive:{c}/x.tar", "read archive"),
    ({}, "docker-archive:{c}/missing.tar", "read archive"),
    ({"index.json": "{}"}, "oci:{c}", "read OCI layout"),
    # Root (this test's user) has no subordinate ids: it must not try to build at all.
    ({"Dockerfile": "FROM rolloutd/default\nRUN true\n"}, "dockerfile:{c}", "apptainer build': user root"),
    ({"index.json": '{"manifests": [{}, {}]}', "oci-layout": "{}"}, "oci:{c}", "read OCI layout"),
])
def test_bad_images_name_the_step(context: Path, files: dict[str, str], image: str, step: str) -> None:
    for name, text in files.items():
        (context / name).write_text(text)
    with pytest.raises(ImageError, match=f"step '{step}"):
        asyncio.run(resolve_image(image.format(c=context)))
