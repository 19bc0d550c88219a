"""Five-field cron expressions: minute hour day-of-month month day-of-week."""
from datetime import datetime, timedelta

# (lowest, highest) allowed value of each field; day of week 0 = Sunday.
BOUNDS = ((0, 59), (0, 23), (1, 31), (1, 12), (0, 6))


class CronError(ValueError):
    pass


def parse_field(spec: str, lo: int, hi: int) -> set[int]:
    """Values matched by one field: `*`, `5`, `1-5`, `*/15`, `10-40/10`, `5/20`, lists with `,`."""
    values: set[int] = set()
    for part in spec.split(","):
        base, has_step, step_text = part.partition("/")
        step = int(step_text) if has_step else 1
        if step < 1:
            raise CronError(f"step must be positive in {part!r}")
        if base == "*":
            start, stop = lo, hi + 1
        elif "-" in base:
            first, last = base.split("-", 1)
            start, stop = int(first), int(last)
        else:
            start = int(base)
            # "5/20" means every 20 starting at 5; a bare "5" is just 5.
            stop = hi + 1 if has_step else start + 1
        if not lo <= start < stop <= hi + 1:
            raise CronError(f"{part!r} is outside {lo}-{hi} or empty")
        values.update(range(start, stop, step))
    return values


class CronSchedule:
    def __init__(self, expression: str) -> None:
        fields = expression.split()
        if len(fields) != 5:
            raise CronError(f"expected 5 fields, got {len(fields)}: {expression!r}")
        try:
            parsed = [parse_field(f, lo, hi) for f, (lo, hi) in zip(fields, BOUNDS)]
        except ValueError as e:
            raise CronError(f"bad cron expression {expression!r}: {e}") from e
        self.minutes, self.hours, self.days, self.months, self.weekdays = parsed

    def matches(self, when: datetime) -> bool:
        return (
            when.minute in self.minutes
            and when.hour in self.hours
            and when.day in self.days
            and when.month in self.months
            and (when.weekday() + 1) % 7 in self.weekdays
        )

    def next_after(self, when: datetime, horizon: timedelta = timedelta(days=8)) -> datetime | None:
        """First matching minute strictly after *when*, within *horizon*."""
        candidate = when.replace(second=0, microsecond=0) + timedelta(minutes=1)
        end = when + horizon
        while candidate <= end:
            if self.matches(candidate):
                return candidate
            candidate += timedelta(minutes=1)
        return None
