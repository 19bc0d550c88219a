from timeslots import covered, free_slots, merge


def test_interval_inside_another_is_absorbed():
    assert merge([(1, 10), (2, 3)]) == [(1, 10)]
    assert merge([(0, 100), (10, 20), (30, 40), (50, 60)]) == [(0, 100)]


def test_covered_counts_nested_meetings_once():
    assert covered([(60, 180), (90, 120), (170, 175)]) == 120


def test_free_slots_after_long_meeting_with_nested_one():
    busy = [(540, 720), (600, 615)]
    assert free_slots(busy, 480, 1020) == [(480, 540), (720, 1020)]


def test_identical_intervals():
    assert merge([(2, 5), (2, 5)]) == [(2, 5)]
