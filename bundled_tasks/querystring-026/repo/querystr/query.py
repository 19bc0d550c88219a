"""Parsing and building URL query strings (application/x-www-form-urlencoded)."""
from collections.abc import Iterable, Mapping
from urllib.parse import quote_plus, unquote_plus


def parse_query(query: str, keep_blank: bool = True) -> dict[str, list[str]]:
    """Map each key to its values in order of appearance.

    A leading "?" is ignored, "+" means a space and %XX escapes are
    decoded. Pairs without "=" get an empty value; with *keep_blank* false,
    empty values are dropped.
    """
    decoded = unquote_plus(query.removeprefix("?"))
    result: dict[str, list[str]] = {}
    for pair in decoded.split("&"):
        if not pair:
            continue
        key, _, value = pair.partition("=")
        if value or keep_blank:
            result.setdefault(key, []).append(value)
    return result


def build_query(params: Mapping[str, str | Iterable[str]]) -> str:
    """Inverse of parse_query; a list value produces one pair per item."""
    pairs = []
    for key, value in params.items():
        values = [value] if isinstance(value, str) else list(value)
        for item in values:
            pairs.append(f"{quote_plus(key)}={quote_plus(item)}")
    return "&".join(pairs)
