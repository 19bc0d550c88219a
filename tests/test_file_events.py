"""Waiting for names to appear in a folder (inotify), as a kernel's start waits for its sockets."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from rolloutd.native_io.file_events import NamesAppear

APPEAR_S = 5.0
"""How long names made right away may take to be seen on a loaded node."""


async def test_waits_until_every_name_appears_by_creation_or_rename(tmp_path: Path) -> None:
    loop = asyncio.get_running_loop()
    with NamesAppear(tmp_path, ["sock", "moved"]) as watch:
        waiting = asyncio.ensure_future(watch.wait())
        (tmp_path / "other").touch()
        (tmp_path / "sock").touch()
        await asyncio.sleep(0)  # the wait starts: it finds "sock" there and must go on for "moved"
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


def test_a_link_in_place_of_the_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(OSError, match="watching"):
        NamesAppear(tmp_path / "link", ["x"])
