from csvline.reader import ParseError, read_records, split_line

__all__ = ["ParseError", "read_records", "split_line"]
