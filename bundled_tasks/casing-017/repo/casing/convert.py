"""Conversions between camelCase, PascalCase, snake_case and kebab-case identifiers."""
import re

_LOWER_TO_UPPER = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_SEPARATORS = re.compile(r"[\s_-]+")


def words(name: str) -> list[str]:
    """Split an identifier in any supported style into lower-case words."""
    spaced = _LOWER_TO_UPPER.sub(" ", name)
    return [w.lower() for w in _SEPARATORS.split(spaced) if w]


def to_snake(name: str) -> str:
    """'parseJsonData' -> 'parse_json_data'."""
    return "_".join(words(name))


def to_kebab(name: str) -> str:
    """'parseJsonData' -> 'parse-json-data'."""
    return "-".join(words(name))


def to_camel(name: str, upper_first: bool = False) -> str:
    """'parse_json_data' -> 'parseJsonData' ('ParseJsonData' with upper_first)."""
    parts = words(name)
    if not parts:
        return ""
    head = parts[0].capitalize() if upper_first else parts[0]
    return head + "".join(p.capitalize() for p in parts[1:])
