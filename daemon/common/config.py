"""Typed configuration both daemons load the same way: defaults < TOML file < ``<PREFIX>*``
environment variables < command-line flags; unknown keys and wrong types are errors."""

from __future__ import annotations

import dataclasses
import os
import tomllib
import typing
from typing import Any

from rolloutd.native_io.errors import BadRequest, ConfigError
from rolloutd.native_io.wire import from_fields


def _coerce_env(tp: Any, raw: str, name: str) -> Any:
    origin = typing.get_origin(tp)
    try:
        if tp is bool:
            if raw.lower() in ("1", "true", "yes", "on"):
                return True
            if raw.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if tp is int:
            return int(raw)
        if tp is float:
            return float(raw)
        if origin is list:
            return [x for x in raw.split(",") if x]
        return raw
    except ValueError as e:
        raise ConfigError(f"{name}={raw!r} is not a valid {getattr(tp, '__name__', tp)}") from e


def load_typed_config(config_cls: type, env_prefix: str, path: str | None = None,
                      overrides: dict[str, Any] | None = None, environ: dict[str, str] | None = None) -> Any:
    """Defaults, then the TOML file (``path`` or ``$<prefix>CONFIG``), then env, then ``overrides``.

    ``config_cls`` is a config dataclass (the node's or the router's), ``env_prefix`` its variables'.
    """
    env = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    path = path or env.get(f"{env_prefix}CONFIG")
    if path:
        try:
            with open(path, "rb") as f:
                values.update(tomllib.load(f))
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cannot read config file {path}: {e}") from e
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        key = f"{env_prefix}{f.name.upper()}"
        if key in env:
            values[f.name] = _coerce_env(hints[f.name], env[key], key)
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        return from_fields(config_cls, values, where=config_cls.__name__.replace("Config", " config").lower())
    except BadRequest as e:
        raise ConfigError(str(e)) from e
