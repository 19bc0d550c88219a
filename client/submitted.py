"""The rollouts a client has submitted and not yet handed out: each id's one answer, its deadline,
and how many submits of it still wait (an id submitted twice joins the first)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class _Submitted(Generic[T]):
    answer: asyncio.Future[T]
    deadline: float
    """Loop time by which the daemon has answered or is broken (the request's own timeout plus a margin)."""
    askers: int = 1


class SubmittedRollouts(Generic[T]):
    def __init__(self) -> None:
        self._by_id: dict[str, _Submitted[T]] = {}

    def add(self, rid: str, answer: asyncio.Future[T], deadline: float) -> None:
        held = self._by_id.get(rid)
        if held is None:
            self._by_id[rid] = _Submitted(answer, deadline)
        else:
            held.answer, held.deadline, held.askers = answer, deadline, held.askers + 1

    def answer(self, rid: str) -> asyncio.Future[T]:
        return self._by_id[rid].answer

    def latest_deadline(self, ids: list[str], default: float) -> float:
        return max((self._by_id[rid].deadline for rid in ids), default=default)

    def hand_out(self, rid: str, asked: int) -> bool:
        """Count ``asked`` submits of ``rid`` as answered; True while another still waits for it."""
        held = self._by_id.get(rid)
        if held is None:
            return False
        held.askers -= asked
        if held.askers <= 0:
            del self._by_id[rid]
            return False
        return True
