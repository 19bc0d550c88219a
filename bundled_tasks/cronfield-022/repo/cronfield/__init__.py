from cronfield.schedule import CronError, CronSchedule, parse_field

__all__ = ["CronError", "CronSchedule", "parse_field"]
