"""A sandbox can write its run folder (the command files of its shell, its kernel's files live
there) and so replace any entry in it with a link to a host file. The daemon makes its files there
afresh and reads them without following a link: what the sandbox planted is never written
through (``native_io/host_files.py``)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from rolloutd.daemon.sandbox.base import SandboxBackend, SandboxSpec
from rolloutd.daemon.sandbox.lease import open_lease
from rolloutd.native_io.errors import CommandTimeout
from rolloutd.native_io.host_files import read_tail
from rolloutd.native_io.pty_command import COMMAND_FILE

PRECIOUS = "a host file the sandbox must not reach\n"


def _victims(folder: Path, names: list[str]) -> dict[str, Path]:
    out = {}
    for name in names:
        out[name] = folder / f"victim-{name}"
        out[name].write_text(PRECIOUS)
    return out


async def test_a_link_planted_in_the_command_folder_is_not_written_through(backend: SandboxBackend,
                                                                          short_tmp: Path) -> None:
    lease = await open_lease(backend.create(SandboxSpec(ipython=False)))
    try:
        victims = _victims(short_tmp, [f"{COMMAND_FILE}.next"])
        sh = f"{lease.sandbox.run_dir_inside}/sh"
        # After an interrupt the next command goes to a new command file, made under this name
        # and renamed over the old one: the moment the daemon creates a file there again.
        planted = await lease.run(f"ln -sf {victims[f'{COMMAND_FILE}.next']} {sh}/{COMMAND_FILE}.next && echo ok")
        assert planted.output.strip() == "ok"
        try:
            await lease.run("sleep 30", timeout_s=0.5)
        except CommandTimeout:
            pass
        r = await lease.run("echo 'the shell still answers'")
        assert r.output.strip() == "the shell still answers"
        assert {name: path.read_text() for name, path in victims.items()} == dict.fromkeys(victims, PRECIOUS)
    finally:
        await lease.destroy()


async def test_a_kernel_starts_without_writing_through_links_in_the_run_folder(backend: SandboxBackend,
                                                                              short_tmp: Path) -> None:
    lease = await open_lease(backend.create(SandboxSpec(ipython=True)))
    try:
        names = ["kernel.json", "kernel_launcher.py", "kernel.log"]
        victims = _victims(short_tmp, names)
        run = lease.sandbox.run_dir_inside
        # The kernel starts on the first cell, after the agent's commands could plant these.
        await lease.run(" && ".join(f"ln -s {victims[n]} {run}/{n}" for n in names))
        result = await lease.ipython("print(6 * 7)")
        assert result.stdout.strip() == "42", result
        assert {name: path.read_text() for name, path in victims.items()} == dict.fromkeys(victims, PRECIOUS)
    finally:
        await lease.destroy()


async def test_a_log_tail_is_not_read_from_a_fifo_or_through_a_link(short_tmp: Path) -> None:
    os.mkfifo(short_tmp / "fifo.log")
    (short_tmp / "linked.log").symlink_to(short_tmp / "target")
    (short_tmp / "target").write_text("host secret")
    (short_tmp / "plain.log").write_text("x" * 10 + "tail")
    assert await asyncio.wait_for(asyncio.to_thread(read_tail, short_tmp, "fifo.log", 100), 10) == b""
    assert read_tail(short_tmp, "linked.log", 100) == b""
    assert read_tail(short_tmp, "plain.log", 4) == b"tail"
