"""Shells and kernels start inside an Apptainer instance by joining its namespaces (``ns_join``):
the same sandbox as through ``apptainer exec``, as root and as an ordinary user, and a symlink the
sandbox plants cannot take a new process's working folder outside it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from os_users import run_json_script
from rolloutd.daemon.sandbox.ns_join import namespace_join

pytestmark = pytest.mark.apptainer
SCRIPT = Path(__file__).with_name("ns_join_probe.py")


def _probe(as_user: bool) -> dict[str, dict[str, object]]:
    return run_json_script(SCRIPT, as_user=as_user)  # type: ignore[no-any-return]


@pytest.mark.parametrize("who", ["root", "ordinary user"])
def test_a_joined_shell_is_in_the_same_sandbox_as_apptainer_exec(who: str) -> None:
    if who == "root" and os.getuid() != 0:
        pytest.skip("the root case needs root (CI runs as root)")
    seen = _probe(as_user=who == "ordinary user")
    joined, reference = seen["nsenter"], seen["apptainer"]
    assert joined["joined"] and not reference["joined"]
    for fact in ("cwd", "uid", "gid", "same_namespaces_as_init"):
        assert joined[fact] == reference[fact], fact
    assert joined["same_namespaces_as_init"] == {n: True for n in ("mnt", "pid", "user", "net", "ipc")}
    assert joined["uid"] == joined["own_uid"] and joined["cwd"] == "/workspace"
    assert joined["no_new_privs"] == "1"  # also for root, whose apptainer exec leaves it off
    if who == "ordinary user":
        assert reference["no_new_privs"] == "1"
        assert joined["cap_eff"] == reference["cap_eff"] == "0000000000000000"
    # The caller's variables and the instance's own reach the shell; nothing of the daemon's.
    assert {"HOME", "PATH", "LANG", "TERM", "PAGER", "APPTAINER_CONTAINER", "APPTAINER_INSTANCE"} <= set(joined["env_names"])
    assert set(joined["env_names"]) <= set(reference["env_names"])
    assert "ROLLOUTD_CACHE_DIR" not in joined["env_names"]


@pytest.mark.parametrize("via", ["nsenter", "apptainer"])
def test_a_planted_symlink_keeps_the_working_folder_inside(via: str) -> None:
    seen = _probe(as_user=os.getuid() == 0)[via]
    listing = seen["symlinked_cwd_listing"]
    assert ".singularity.d" in listing, listing  # the container's root, twice
    assert seen["host_marker"] not in listing and "work" not in listing


def test_no_join_where_the_instance_has_no_namespaces_of_its_own() -> None:
    # This process's own namespaces are the host's: joining "them" would start a process outside.
    assert namespace_join(os.getpid(), image="/img", instance="rld-x") is None
