from datetime import datetime

from cronfield import CronSchedule, parse_field


def test_range_includes_its_upper_bound():
    assert parse_field("1-5", 0, 6) == {1, 2, 3, 4, 5}
    assert parse_field("0-59", 0, 59) == set(range(60))


def test_stepped_range_and_single_value_range():
    assert parse_field("9-17/2", 0, 23) == {9, 11, 13, 15, 17}
    assert parse_field("5-5", 0, 59) == {5}


def test_weekday_schedule_runs_on_friday():
    sched = CronSchedule("0 9 * * 1-5")
    friday = datetime(2024, 3, 8, 9, 0)
    assert sched.matches(friday)
    assert sched.next_after(datetime(2024, 3, 7, 12, 0)) == friday


def test_weekday_schedule_skips_weekend():
    sched = CronSchedule("0 9 * * 1-5")
    assert sched.next_after(datetime(2024, 3, 9, 10, 0)) == datetime(2024, 3, 11, 9, 0)
