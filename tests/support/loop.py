"""Coroutines of sync tests run on uvloop, the loop every rolloutd process runs on."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
    """``coro`` on a fresh uvloop, bounded by ``timeout_s``."""
    async def bounded() -> T:
        if not isinstance(asyncio.get_running_loop(), uvloop.Loop):  # the point of this helper
            raise RuntimeError("support.loop.run must run its coroutine on uvloop")
        async with asyncio.timeout(timeout_s):
            return await coro
    return uvloop.run(bounded())
