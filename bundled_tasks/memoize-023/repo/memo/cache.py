"""Memoization with optional expiry."""
import functools
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

_KWARGS_MARK = object()


@dataclass
class CacheInfo:
    hits: int = 0
    misses: int = 0
    size: int = 0


def _make_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
    """A key that is equal for equal calls, whatever order keywords are given in."""
    key: tuple[Any, ...] = args
    if kwargs:
        key += (_KWARGS_MARK,) + tuple(sorted(kwargs))
    return key


def memoize(ttl_s: float | None = None, clock: Callable[[], float] = time.monotonic):
    """Cache results per distinct call; entries expire after *ttl_s* seconds if given.

    Arguments must be hashable. The wrapper gets `cache_info()` and
    `cache_clear()`.
    """

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        entries: dict[Hashable, tuple[float, Any]] = {}
        info = CacheInfo()

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            key = _make_key(args, kwargs)
            now = clock()
            hit = entries.get(key)
            if hit is not None and (ttl_s is None or now - hit[0] < ttl_s):
                info.hits += 1
                return hit[1]
            info.misses += 1
            result = fn(*args, **kwargs)
            entries[key] = (now, result)
            return result

        def cache_info() -> CacheInfo:
            return CacheInfo(info.hits, info.misses, len(entries))

        def cache_clear() -> None:
            entries.clear()
            info.hits = info.misses = 0

        wrapper.cache_info = cache_info  # type: ignore[attr-defined]
        wrapper.cache_clear = cache_clear  # type: ignore[attr-defined]
        return wrapper

    return decorate
