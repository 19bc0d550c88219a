"""Waits that poll a named condition until a deadline, never a bare sleep: a wait that runs out
fails naming what it waited for and for how long."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

POLL_S = 0.01
"""How often a condition is asked again: short, as every condition here is cheap to ask."""


def wait_until(condition: Callable[[], T], timeout_s: float, what: str, poll_s: float = POLL_S) -> T:
    """The condition's first truthy value; TimeoutError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s} s")
        time.sleep(poll_s)
    return value


async def async_wait_until(condition: Callable[[], T], timeout_s: float, what: str, poll_s: float = POLL_S) -> T:
    """As :func:`wait_until`, inside a coroutine (the loop keeps running while it waits)."""
    try:
        async with asyncio.timeout(timeout_s):
            while not (value := condition()):
                await asyncio.sleep(poll_s)
            return value
    except TimeoutError as e:
        raise TimeoutError(f"{what} did not happen within {timeout_s} s") from e


async def async_poll(ask: Callable[[], Awaitable[T]], good: Callable[[T], bool], timeout_s: float, what: str,
                     poll_s: float = 0.1) -> T:
    """Ask (a coroutine: a status request, say) until ``good`` holds for the answer; the last
    answer is named in the TimeoutError."""
    deadline = time.monotonic() + timeout_s
    while True:
        answer = await ask()
        if good(answer):
            return answer
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout_s} s; last seen: {answer!r}")
        await asyncio.sleep(poll_s)
