"""Waiting for names to appear in a folder (inotify), as a kernel's start waits for its sockets."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from support.descriptors import descriptor_targets
from support.waits import async_wait_until

from rolloutd.native_io.file_events import NamesAppear

APPEAR_S = 5.0
"""How long names made right away may take to be seen on a loaded node."""


async def test_waits_until_every_name_appears_by_creation_or_rename(tmp_path: Path) -> None:
    loop = asyncio.get_running_loop()
    with NamesAppear(tmp_path, ["sock", "moved"]) as watch:
        waiting = asyncio.ensure_future(watch.wait())
        (tmp_path / "other").touch()
        (tmp_path / "sock").touch()
        # A zero-second yield, not a wait on time: the wait's task starts, finds "sock" there and
        # must go on for "moved".
        await asyncio.sleep(0)
        assert not waiting.done()
        (tmp_path / "staging").touch()
        loop.call_soon(os.rename, tmp_path / "staging", tmp_path / "moved")
        await asyncio.wait_for(waiting, APPEAR_S)


async def test_a_name_already_there_counts_and_one_made_then_removed_does_not(tmp_path: Path) -> None:
    (tmp_path / "early").touch()
    with NamesAppear(tmp_path, ["early", "late"]) as watch:
        (tmp_path / "late").touch()
        (tmp_path / "late").unlink()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(watch.wait(), 0.3)  # 0.3 s: the time during which it must not return
        (tmp_path / "late").touch()
        await asyncio.wait_for(watch.wait(), APPEAR_S)


async def test_a_link_in_place_of_the_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    before = _inotify_instances()
    with pytest.raises(OSError, match="watching"):
        NamesAppear(tmp_path / "link", ["x"])
    await _closed_to(before)


def _inotify_instances() -> int:
    return descriptor_targets().count("anon_inode:inotify")


CLOSE_S = 5.0
"""How long an idle instance's close, in a thread off the loop, may take on a loaded node."""


async def _closed_to(count: int) -> None:
    """Until this process holds ``count`` inotify instances (the close runs in a thread)."""
    await async_wait_until(lambda: _inotify_instances() == count, CLOSE_S, f"{count} inotify instances left")


async def test_the_waits_of_a_loop_share_one_instance_closed_after_the_last(tmp_path: Path) -> None:
    """A user has 128 inotify instances by default, shared with what their sandboxes run."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    before = _inotify_instances()
    watches = [NamesAppear(tmp_path / "a", ["x"]), NamesAppear(tmp_path / "a", ["y"]),
               NamesAppear(tmp_path / "b", ["x"])]
    assert _inotify_instances() == before + 1
    watches[0].close()
    (tmp_path / "a" / "y").touch()
    await asyncio.wait_for(watches[1].wait(), APPEAR_S)  # its folder's watch outlived the first wait's
    for watch in watches[1:]:
        watch.close()
    await _closed_to(before)
