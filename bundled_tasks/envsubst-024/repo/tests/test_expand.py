import pytest

from envsubst import UndefinedVariable, expand


def test_plain_and_braced_names():
    env = {"HOST": "db", "PORT": "5432"}
    assert expand("postgres://$HOST:${PORT}/app", env) == "postgres://db:5432/app"


def test_defaults_for_unset_variables():
    assert expand("${USER-nobody} ${SHELL:-/bin/sh}", {}) == "nobody /bin/sh"


def test_dash_without_colon_keeps_empty_value():
    assert expand("[${OPTS-default}]", {"OPTS": ""}) == "[]"


def test_dollar_escape_and_strict_mode():
    assert expand("cost: $$5", {}) == "cost: $5"
    assert expand("$MISSING!", {}) == "!"
    with pytest.raises(UndefinedVariable):
        expand("$MISSING", {}, strict=True)
