import pytest

from pctl import percentile, summary


def test_median():
    assert percentile([3, 1, 2], 50) == 2
    assert percentile([1, 2, 3, 4], 50) == 2.5


def test_interpolates_between_ranks():
    assert percentile([10, 20, 30, 40, 50], 0) == 10
    assert percentile([10, 20, 30, 40, 50], 30) == pytest.approx(22.0)


def test_rejects_bad_input():
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1, 2], 101)


def test_summary_of_many_values():
    s = summary(list(range(101)))
    assert (s["min"], s["p50"], s["p90"], s["max"]) == (0, 50, 90, 100)
