"""Parsing and building URL query strings (application/x-www-form-urlencoded)."""
from collections.abc import Iterable, Mapping
from urllib.parse import quote_plus, unquote_plus


def parse_query(query: str, keep_blank: bool = True) -> dict[str, list[str]]:
    """Map each key to its values in order of appearance.

    A leading "?" is ignored, "+" means a space and %XX escapes are
    decoded. Pairs without "=" get an empty value; with *keep_blank* false,
    empty values are dropped.
    """
    result: dict[str, list[str]] = {}
    # Split on the raw separators first: "%26" and "%3D" are data, not separators.
    for pair in query.removeprefix("?").split("&"):
        if not pair:
            continue
        raw_key, _, raw_value = pair.partition("=")
        key, value = unquote_plus(raw_key), unquote_plus(raw_value)
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
