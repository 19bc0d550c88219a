"""A minimal reader for delimiter-separated lines with quoted fields."""


class ParseError(ValueError):
    pass


def split_line(line: str, delimiter: str = ",", quote: str = '"') -> list[str]:
    """Split one line into fields.

    A field may be wrapped in *quote* characters so that it can contain the
    delimiter; inside such a field a doubled quote stands for one literal
    quote character, as in RFC 4180.
    """
    fields: list[str] = []
    buf: list[str] = []
    in_quotes = False
    for ch in line:
        if ch == quote:
            in_quotes = not in_quotes
        elif ch == delimiter and not in_quotes:
            fields.append("".join(buf))
            buf = []
        else:
            buf.append(ch)
    if in_quotes:
        raise ParseError(f"unterminated quoted field in line: {line!r}")
    fields.append("".join(buf))
    return fields


def read_records(text: str, delimiter: str = ",") -> list[dict[str, str]]:
    """Parse *text* whose first line is a header into one dict per row."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return []
    header = split_line(lines[0], delimiter)
    records = []
    for number, line in enumerate(lines[1:], start=2):
        values = split_line(line, delimiter)
        if len(values) != len(header):
            raise ParseError(f"line {number}: expected {len(header)} fields, got {len(values)}")
        records.append(dict(zip(header, values)))
    return records
