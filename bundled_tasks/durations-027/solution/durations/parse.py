"""Compact human durations such as "1h30m", "2d", "1.5s" or "250ms"."""
import re
from datetime import timedelta

_MS_PER_UNIT = {"d": 86_400_000, "h": 3_600_000, "m": 60_000, "s": 1_000, "ms": 1}
# "ms" must come before "m" in the alternation, or "250ms" matches as 250 minutes + a stray "s".
_TOKEN = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(ms|d|h|m|s)")


class DurationError(ValueError):
    pass


def parse_duration(text: str) -> timedelta:
    """Sum of number+unit tokens; units d, h, m, s, ms; spaces between tokens are allowed."""
    source = text.strip().lower()
    if not source:
        raise DurationError("empty duration")
    total_ms = 0.0
    pos = 0
    while pos < len(source):
        match = _TOKEN.match(source, pos)
        if match is None:
            raise DurationError(f"cannot parse {text!r} at {source[pos:]!r}")
        number, unit = match.groups()
        total_ms += float(number) * _MS_PER_UNIT[unit]
        pos = match.end()
    return timedelta(milliseconds=total_ms)


def format_duration(delta: timedelta) -> str:
    """Inverse of parse_duration, rounded to whole milliseconds: 90.5 s -> "1m30s500ms"."""
    remaining = round(delta.total_seconds() * 1000)
    if remaining < 0:
        raise DurationError("negative durations are not supported")
    if remaining == 0:
        return "0s"
    parts = []
    for unit, size in _MS_PER_UNIT.items():
        count, remaining = divmod(remaining, size)
        if count:
            parts.append(f"{count}{unit}")
    return "".join(parts)
