import pytest

from timeslots import covered, free_slots, merge


def test_merges_overlapping_and_touching():
    assert merge([(5, 8), (1, 3), (3, 4), (7, 10)]) == [(1, 4), (5, 10)]


def test_rejects_reversed_interval():
    with pytest.raises(ValueError):
        merge([(4, 2)])


def test_free_slots_between_meetings():
    assert free_slots([(540, 600), (630, 660)], 480, 720) == [(480, 540), (600, 630), (660, 720)]


def test_min_length_filters_short_gaps():
    assert free_slots([(10, 20), (25, 40)], 0, 50, min_length=8) == [(0, 10), (40, 50)]
