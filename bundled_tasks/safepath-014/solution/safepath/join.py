"""Map user-supplied paths onto a directory without letting them escape it."""
import posixpath
from urllib.parse import unquote, urlsplit


class UnsafePath(ValueError):
    """The requested path resolves outside of the allowed root directory."""


def safe_join(root: str, *parts: str) -> str:
    """Join *parts* onto *root* and normalise; refuse results outside *root*.

    Works on POSIX path strings only; the file system is not consulted, so
    symlinks are not resolved.
    """
    root = posixpath.normpath(root)
    candidate = posixpath.normpath(posixpath.join(root, *parts))
    # A plain prefix test would accept the sibling "/srv/data-x" for root
    # "/srv/data"; compare whole path components instead.
    if posixpath.commonpath([root, candidate]) != root:
        raise UnsafePath(f"{posixpath.join(*parts) if parts else ''!r} escapes {root!r}")
    return candidate


def resolve_url_path(root: str, url: str) -> str:
    """File path for the path component of *url* (query and fragment ignored)."""
    path = unquote(urlsplit(url).path)
    return safe_join(root, path.lstrip("/"))
