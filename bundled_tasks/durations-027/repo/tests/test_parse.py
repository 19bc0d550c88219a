from datetime import timedelta

import pytest

from durations import DurationError, format_duration, parse_duration


def test_common_forms():
    assert parse_duration("1h30m") == timedelta(minutes=90)
    assert parse_duration(" 2d 4h ") == timedelta(days=2, hours=4)
    assert parse_duration("1.5s") == timedelta(seconds=1.5)
    assert parse_duration("45S") == timedelta(seconds=45)


def test_rejects_garbage():
    for text in ("", "abc", "10", "5 parsecs", "1h-2m"):
        with pytest.raises(DurationError):
            parse_duration(text)


def test_format():
    assert format_duration(timedelta(hours=26, seconds=5)) == "1d2h5s"
    assert format_duration(timedelta(0)) == "0s"
