import pytest

from pctl import percentile, summary


def test_hundredth_percentile_is_maximum():
    assert percentile([5, 1, 9, 3], 100) == 9


def test_single_value():
    assert percentile([42.0], 0) == 42.0
    assert percentile([42.0], 73.5) == 42.0
    assert summary([7.5]) == {"min": 7.5, "p50": 7.5, "p90": 7.5, "p99": 7.5, "max": 7.5}


def test_exact_rank_at_top_of_two_values():
    assert percentile([1, 3], 100) == 3


def test_high_percentile_interpolation():
    assert percentile(list(range(11)), 95) == pytest.approx(9.5)
