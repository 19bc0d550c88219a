from datetime import timedelta

from durations import format_duration, parse_duration


def test_milliseconds():
    assert parse_duration("250ms") == timedelta(milliseconds=250)
    assert parse_duration("1s 500ms") == timedelta(milliseconds=1500)


def test_round_trip_with_milliseconds():
    for delta in (timedelta(milliseconds=1500), timedelta(minutes=1, seconds=30, milliseconds=5)):
        assert parse_duration(format_duration(delta)) == delta


def test_minutes_still_minutes():
    assert parse_duration("3m") == timedelta(minutes=3)
    assert format_duration(timedelta(seconds=90.5)) == "1m30s500ms"
