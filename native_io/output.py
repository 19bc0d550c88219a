"""Bounded capture of a command's output: head and tail kept, every byte counted."""

from __future__ import annotations


class OutputCollector:
    """Keeps the first and last halves of a command's output and counts every byte."""

    def __init__(self, cap: int) -> None:
        self.head_cap = cap // 2
        self.tail_cap = cap - self.head_cap
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def add(self, data: bytes | bytearray | memoryview) -> None:
        self.total += len(data)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > 2 * self.tail_cap:
                del self.tail[: len(self.tail) - self.tail_cap]

    def text(self) -> tuple[str, bool]:
        if len(self.tail) > self.tail_cap:
            del self.tail[: len(self.tail) - self.tail_cap]
        kept = len(self.head) + len(self.tail)
        truncated = kept < self.total
        if not truncated:
            return (bytes(self.head) + bytes(self.tail)).decode("utf-8", "replace"), False
        marker = f"\n[... {self.total - kept} bytes omitted of {self.total} ...]\n"
        return (
            self.head.decode("utf-8", "replace") + marker + self.tail.decode("utf-8", "replace"),
            True,
        )


TAIL_CHARS = 500
"""How much of a command's output an error message quotes: its end, where the error usually is."""
LOG_TAIL_CHARS = 2000
"""How much of a process's log an error message quotes when the process failed to start."""


def tail(text: str, n: int = TAIL_CHARS) -> str:
    """The end of ``text`` that an error message quotes (all of it when shorter)."""
    return text[-n:]
