"""A small least-recently-used cache with an eviction callback."""
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Any

EvictCallback = Callable[[Hashable, Any], None]


class LRUCache:
    """Keeps at most *capacity* entries, dropping the least recently used one."""

    def __init__(self, capacity: int, on_evict: EvictCallback | None = None) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._data: OrderedDict[Hashable, Any] = OrderedDict()
        self._on_evict = on_evict
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable, default: Any = None) -> Any:
        try:
            value = self._data[key]
        except KeyError:
            self.misses += 1
            return default
        self._data.move_to_end(key)
        self.hits += 1
        return value

    def put(self, key: Hashable, value: Any) -> None:
        """Insert or update *key*; it becomes the most recently used entry."""
        if len(self._data) >= self.capacity:
            old_key, old_value = self._data.popitem(last=False)
            if self._on_evict is not None:
                self._on_evict(old_key, old_value)
        self._data[key] = value
        self._data.move_to_end(key)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def keys(self) -> Iterator[Hashable]:
        """Keys from least to most recently used."""
        return iter(list(self._data))
