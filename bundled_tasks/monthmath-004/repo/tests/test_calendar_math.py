from datetime import date

from monthmath import add_months, end_of_month


def test_clamps_to_end_of_shorter_month():
    assert add_months(date(2024, 1, 31), 1) == date(2024, 2, 29)
    assert add_months(date(2023, 1, 31), 1) == date(2023, 2, 28)


def test_adds_whole_years():
    assert add_months(date(2022, 3, 15), 12) == date(2023, 3, 15)


def test_goes_back_across_year():
    assert add_months(date(2024, 1, 10), -2) == date(2023, 11, 10)


def test_end_of_month():
    assert end_of_month(date(2024, 4, 3)) == date(2024, 4, 30)
