"""Calendar-month arithmetic on datetime.date values."""
import calendar
from collections.abc import Iterator
from datetime import date


def days_in_month(year: int, month: int) -> int:
    return calendar.monthrange(year, month)[1]


def add_months(day: date, months: int) -> date:
    """Move *day* by a number of calendar months (negative goes back).

    The day of the month is clamped to the length of the target month, so
    January 31 plus one month is the last day of February.
    """
    total = day.month + months
    year = day.year + total // 12
    month = total % 12 or 12
    return day.replace(year=year, month=month, day=min(day.day, days_in_month(year, month)))


def end_of_month(day: date) -> date:
    return day.replace(day=days_in_month(day.year, day.month))


def month_starts(start: date, end: date) -> Iterator[date]:
    """First day of every month from *start*'s month through *end*'s month."""
    current = start.replace(day=1)
    while current <= end:
        yield current
        current = add_months(current, 1)
