"""Shell-style variable expansion for configuration templates."""
import os
import re
from collections.abc import Mapping

_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_PATTERN = re.compile(
    rf"\$(?:(?P<dollar>\$)|\{{(?P<braced>{_NAME})(?:(?P<op>:?-)(?P<default>[^}}]*))?\}}|(?P<bare>{_NAME}))"
)


class UndefinedVariable(KeyError):
    pass


def expand(template: str, env: Mapping[str, str] | None = None, strict: bool = False) -> str:
    """Expand `$NAME`, `${NAME}`, `${NAME-default}`, `${NAME:-default}` and `$$`.

    As in POSIX sh, `${NAME-default}` uses the default only when NAME is
    unset, `${NAME:-default}` also when NAME is set but empty. `$$` is a
    literal dollar sign. Unset variables without a default expand to ""
    unless *strict* is true, in which case UndefinedVariable is raised.
    """
    variables = os.environ if env is None else env

    def substitute(match: re.Match[str]) -> str:
        if match.group("dollar"):
            return "$"
        name = match.group("braced") or match.group("bare")
        if match.group("op") is not None:
            value = variables.get(name)
            if value is None or (match.group("op") == ":-" and value == ""):
                return match.group("default")
            return value
        if name not in variables:
            if strict:
                raise UndefinedVariable(name)
            return ""
        return variables[name]

    return _PATTERN.sub(substitute, template)
