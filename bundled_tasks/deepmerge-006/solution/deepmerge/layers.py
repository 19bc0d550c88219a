"""Layered configuration: later layers override earlier ones, key by key."""
from collections.abc import Mapping
from typing import Any


class _Delete:
    def __repr__(self) -> str:
        return "DELETE"


DELETE: Any = _Delete()
"""Use as a value in a layer to remove the key set by earlier layers."""


def _merge_into(target: dict[str, Any], layer: Mapping[str, Any]) -> dict[str, Any]:
    for key, value in layer.items():
        if value is DELETE:
            target.pop(key, None)
            continue
        current = target.get(key)
        if isinstance(current, dict) and isinstance(value, Mapping):
            _merge_into(current, value)
        elif isinstance(value, Mapping):
            # Store a copy: later layers merge into this dict in place.
            target[key] = _merge_into({}, value)
        else:
            target[key] = value
    return target


def merge(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """Merge *layers* left to right into a new dict.

    Nested mappings are merged recursively; any other value (lists
    included) replaces the earlier one. The layers themselves are never
    modified.
    """
    result: dict[str, Any] = {}
    for layer in layers:
        _merge_into(result, layer)
    return result
