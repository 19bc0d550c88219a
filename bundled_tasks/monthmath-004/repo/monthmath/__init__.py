from monthmath.calendar_math import add_months, days_in_month, end_of_month, month_starts

__all__ = ["add_months", "days_in_month", "end_of_month", "month_starts"]
