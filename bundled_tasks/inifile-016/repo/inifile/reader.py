"""Reader for simple INI files: [sections], `key = value` or `key: value`, # and ; comments."""
import re

_DELIMITER = re.compile(r"\s*[=:]\s*")


class IniError(ValueError):
    pass


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
        return value[1:-1]
    return value


def parse_ini(text: str) -> dict[str, dict[str, str]]:
    """Parse *text* into {section: {key: value}}. Keys are lower-cased."""
    sections: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1].strip(), {})
            continue
        if current is None:
            raise IniError(f"line {lineno}: key outside of any [section]")
        if not _DELIMITER.search(line):
            raise IniError(f"line {lineno}: expected 'key = value', got {line!r}")
        key, value, *_ = _DELIMITER.split(line)
        if not key:
            raise IniError(f"line {lineno}: empty key")
        current[key.lower()] = _unquote(value)
    return sections


def get_int(config: dict[str, dict[str, str]], section: str, key: str, default: int) -> int:
    try:
        raw = config[section][key]
    except KeyError:
        return default
    try:
        return int(raw)
    except ValueError as e:
        raise IniError(f"[{section}] {key} must be an integer, got {raw!r}") from e
