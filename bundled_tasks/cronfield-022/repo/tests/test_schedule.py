from datetime import datetime

import pytest

from cronfield import CronError, CronSchedule, parse_field


def test_star_step_and_lists():
    assert parse_field("*/15", 0, 59) == {0, 15, 30, 45}
    assert parse_field("1,15,30", 1, 31) == {1, 15, 30}
    assert parse_field("5/20", 0, 59) == {5, 25, 45}


def test_out_of_range_values_are_rejected():
    for expr in ("60 * * * *", "* 24 * * *", "* * 0 * *", "* * * * 7", "*/0 * * * *"):
        with pytest.raises(CronError):
            CronSchedule(expr)


def test_matches_and_next_after():
    sched = CronSchedule("30 8 * * *")
    assert sched.matches(datetime(2024, 3, 4, 8, 30))
    assert sched.next_after(datetime(2024, 3, 4, 8, 30)) == datetime(2024, 3, 5, 8, 30)
