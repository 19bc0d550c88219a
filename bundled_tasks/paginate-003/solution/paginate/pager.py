"""Split a sequence into numbered pages."""
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


class PageNotFound(LookupError):
    pass


@dataclass
class Page:
    number: int
    items: Sequence[Any]
    paginator: "Paginator"

    @property
    def has_next(self) -> bool:
        return self.number < self.paginator.num_pages

    @property
    def has_previous(self) -> bool:
        return self.number > 1

    @property
    def start_index(self) -> int:
        """1-based index of the first item on this page (0 for an empty page)."""
        if not self.items:
            return 0
        return (self.number - 1) * self.paginator.per_page + 1

    @property
    def end_index(self) -> int:
        """1-based index of the last item on this page (0 for an empty page)."""
        if not self.items:
            return 0
        return self.start_index + len(self.items) - 1


class Paginator:
    """Pages of *per_page* items; an empty sequence still has one (empty) page."""

    def __init__(self, items: Sequence[Any], per_page: int) -> None:
        if per_page < 1:
            raise ValueError("per_page must be at least 1")
        self.items = items
        self.per_page = per_page

    @property
    def count(self) -> int:
        return len(self.items)

    @property
    def num_pages(self) -> int:
        full, rest = divmod(self.count, self.per_page)
        return max(1, full + (1 if rest else 0))

    def page(self, number: int) -> Page:
        if not 1 <= number <= self.num_pages:
            raise PageNotFound(f"page {number} is out of range 1..{self.num_pages}")
        start = (number - 1) * self.per_page
        return Page(number, self.items[start:start + self.per_page], self)

    def __iter__(self):
        for number in range(1, self.num_pages + 1):
            yield self.page(number)
