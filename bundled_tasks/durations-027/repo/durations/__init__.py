from durations.parse import DurationError, format_duration, parse_duration

__all__ = ["DurationError", "format_duration", "parse_duration"]
