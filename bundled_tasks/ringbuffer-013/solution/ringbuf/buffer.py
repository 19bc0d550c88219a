"""A fixed-capacity ring buffer that overwrites its oldest item when full."""
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class RingBuffer(Generic[T]):
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._slots: list[T | None] = [None] * capacity
        self._start = 0  # slot of the oldest item
        self._size = 0

    def append(self, item: T) -> None:
        """Add *item* as the newest element, dropping the oldest one when full."""
        self._slots[(self._start + self._size) % self.capacity] = item
        if self._size < self.capacity:
            self._size += 1
        else:
            self._start = (self._start + 1) % self.capacity

    def popleft(self) -> T:
        """Remove and return the oldest item."""
        if not self._size:
            raise IndexError("pop from an empty RingBuffer")
        item = self._slots[self._start]
        self._slots[self._start] = None
        self._start = (self._start + 1) % self.capacity
        self._size -= 1
        return item  # type: ignore[return-value]

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, index: int) -> T:
        """Item by age: 0 is the oldest, -1 the newest."""
        if index < 0:
            index += self._size
        if not 0 <= index < self._size:
            raise IndexError("RingBuffer index out of range")
        return self._slots[(self._start + index) % self.capacity]  # type: ignore[return-value]

    def __iter__(self) -> Iterator[T]:
        """Items from oldest to newest."""
        for i in range(self._size):
            yield self._slots[(self._start + i) % self.capacity]  # type: ignore[misc]

    def latest(self, n: int) -> list[T]:
        """The newest *n* items, oldest first."""
        return list(self)[-n:] if n > 0 else []
