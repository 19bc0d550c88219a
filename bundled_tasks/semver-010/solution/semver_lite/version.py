"""Semantic Versioning 2.0.0 parsing and precedence."""
import functools
import re
from collections.abc import Iterable
from dataclasses import dataclass

_PATTERN = re.compile(
    r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
    r"(?:-([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?"
    r"(?:\+([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?$"
)


class InvalidVersion(ValueError):
    pass


@functools.total_ordering
@dataclass(frozen=True, eq=False)
class Version:
    major: int
    minor: int
    patch: int
    prerelease: tuple[str, ...] = ()
    build: str = ""

    @classmethod
    def parse(cls, text: str) -> "Version":
        match = _PATTERN.match(text.strip())
        if match is None:
            raise InvalidVersion(f"not a semantic version: {text!r}")
        major, minor, patch, pre, build = match.groups()
        return cls(int(major), int(minor), int(patch), tuple(pre.split(".")) if pre else (), build or "")

    def _precedence(self) -> tuple:
        # A release ranks above every pre-release of the same version;
        # build metadata never takes part in precedence.
        # Numeric identifiers compare as numbers and rank below alphanumeric ones.
        pre = tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in self.prerelease)
        return (self.major, self.minor, self.patch, not self.prerelease, pre)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Version):
            return NotImplemented
        return self._precedence() == other._precedence()

    def __lt__(self, other: "Version") -> bool:
        return self._precedence() < other._precedence()

    def __hash__(self) -> int:
        return hash(self._precedence())

    def __str__(self) -> str:
        text = f"{self.major}.{self.minor}.{self.patch}"
        if self.prerelease:
            text += "-" + ".".join(self.prerelease)
        if self.build:
            text += "+" + self.build
        return text


def latest(texts: Iterable[str], include_prereleases: bool = True) -> str | None:
    """The highest version among *texts*, or None when there is none."""
    versions = [Version.parse(t) for t in texts]
    if not include_prereleases:
        versions = [v for v in versions if not v.prerelease]
    return str(max(versions)) if versions else None
