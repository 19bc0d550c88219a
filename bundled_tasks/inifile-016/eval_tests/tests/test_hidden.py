from inifile import parse_ini


def test_value_containing_delimiters_is_kept_whole():
    config = parse_ini("[db]\nurl = postgres://user:secret@db:5432/app?sslmode=require\n")
    assert config["db"]["url"] == "postgres://user:secret@db:5432/app?sslmode=require"


def test_equals_in_value():
    config = parse_ini("[build]\nflags = -O2 -DNAME=value\nexpr: a=b\n")
    assert config["build"] == {"flags": "-O2 -DNAME=value", "expr": "a=b"}


def test_quoted_value_with_colon():
    config = parse_ini('[ui]\ntitle = "Note: unsaved"\n')
    assert config["ui"]["title"] == "Note: unsaved"


def test_empty_value_is_allowed():
    assert parse_ini("[s]\nkey =\n") == {"s": {"key": ""}}
