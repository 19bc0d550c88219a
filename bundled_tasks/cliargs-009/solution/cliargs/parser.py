"""A small command-line parser for long options, flags and positionals."""
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


def _is_option(arg: str) -> bool:
    """True for option words; a lone '-' and negative numbers like -5 or -0.5 are values."""
    if not arg.startswith("-") or arg == "-":
        return False
    try:
        float(arg)
    except ValueError:
        return True
    return False


class UsageError(Exception):
    pass


@dataclass
class Option:
    name: str
    takes_value: bool = True
    default: Any = None
    convert: Callable[[str], Any] = str


@dataclass
class Parsed:
    options: dict[str, Any] = field(default_factory=dict)
    positionals: list[str] = field(default_factory=list)


class ArgParser:
    """Parses `--name value`, `--name=value`, `--flag` and positionals; `--` ends options."""

    def __init__(self) -> None:
        self._options: dict[str, Option] = {}

    def add_option(self, name: str, *, default: Any = None, convert: Callable[[str], Any] = str) -> None:
        self._options[name] = Option(name, True, default, convert)

    def add_flag(self, name: str) -> None:
        self._options[name] = Option(name, False, False)

    def parse(self, argv: Sequence[str]) -> Parsed:
        parsed = Parsed({name: opt.default for name, opt in self._options.items()})
        i = 0
        while i < len(argv):
            arg = argv[i]
            if arg == "--":
                parsed.positionals.extend(argv[i + 1:])
                break
            if arg.startswith("--"):
                name, has_value, value = arg[2:].partition("=")
                opt = self._options.get(name)
                if opt is None:
                    raise UsageError(f"unknown option --{name}")
                if not opt.takes_value:
                    if has_value:
                        raise UsageError(f"flag --{name} takes no value")
                    parsed.options[name] = True
                else:
                    if not has_value:
                        if i + 1 >= len(argv) or _is_option(argv[i + 1]):
                            raise UsageError(f"option --{name} needs a value")
                        i += 1
                        value = argv[i]
                    try:
                        parsed.options[name] = opt.convert(value)
                    except ValueError as e:
                        raise UsageError(f"bad value for --{name}: {value!r}") from e
            elif _is_option(arg):
                raise UsageError(f"unknown option {arg}")
            else:
                parsed.positionals.append(arg)
            i += 1
        return parsed
