from semver_lite.version import InvalidVersion, Version, latest

__all__ = ["InvalidVersion", "Version", "latest"]
