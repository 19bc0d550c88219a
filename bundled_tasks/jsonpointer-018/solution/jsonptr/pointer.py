"""JSON Pointer (RFC 6901): addressing values inside parsed JSON documents."""
from collections.abc import Iterable
from typing import Any


class PointerError(LookupError):
    pass


def escape(token: str) -> str:
    return token.replace("~", "~0").replace("/", "~1")


def unescape(token: str) -> str:
    # "~1" must be decoded first: decoding "~0" first would turn "~01" into "~1" and then "/".
    return token.replace("~1", "/").replace("~0", "~")


def make_pointer(tokens: Iterable[str | int]) -> str:
    """Build a pointer from reference tokens: ["a/b", 0] -> "/a~1b/0"."""
    return "".join("/" + escape(str(t)) for t in tokens)


def split_pointer(pointer: str) -> list[str]:
    """Reference tokens of *pointer*; "" is the whole document."""
    if pointer == "":
        return []
    if not pointer.startswith("/"):
        raise PointerError(f"a JSON pointer starts with '/': {pointer!r}")
    return [unescape(t) for t in pointer[1:].split("/")]


def _child(node: Any, token: str, pointer: str) -> Any:
    if isinstance(node, dict):
        if token not in node:
            raise PointerError(f"{pointer!r}: no member {token!r}")
        return node[token]
    if isinstance(node, list):
        if not token.isdigit() or (token != "0" and token.startswith("0")):
            raise PointerError(f"{pointer!r}: {token!r} is not an array index")
        index = int(token)
        if index >= len(node):
            raise PointerError(f"{pointer!r}: index {index} out of range")
        return node[index]
    raise PointerError(f"{pointer!r}: cannot descend into {type(node).__name__}")


def resolve(document: Any, pointer: str) -> Any:
    node = document
    for token in split_pointer(pointer):
        node = _child(node, token, pointer)
    return node
