from datetime import date

from monthmath import add_months, month_starts


def test_landing_in_december_keeps_year():
    assert add_months(date(2024, 11, 15), 1) == date(2024, 12, 15)
    assert add_months(date(2023, 12, 5), 0) == date(2023, 12, 5)
    assert add_months(date(2022, 12, 1), 12) == date(2023, 12, 1)


def test_back_from_january_to_december():
    assert add_months(date(2024, 1, 31), -1) == date(2023, 12, 31)


def test_month_starts_over_year_end():
    starts = list(month_starts(date(2023, 10, 20), date(2024, 2, 1)))
    assert starts == [date(2023, 10, 1), date(2023, 11, 1), date(2023, 12, 1),
                      date(2024, 1, 1), date(2024, 2, 1)]
