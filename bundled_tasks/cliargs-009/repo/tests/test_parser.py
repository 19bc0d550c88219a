import pytest

from cliargs import ArgParser, UsageError


def make_parser():
    p = ArgParser()
    p.add_option("offset", default=0, convert=int)
    p.add_option("name")
    p.add_flag("verbose")
    return p


def test_defaults_and_values():
    parsed = make_parser().parse(["--offset", "3", "--name=x", "in.txt", "-"])
    assert parsed.options == {"offset": 3, "name": "x", "verbose": False}
    assert parsed.positionals == ["in.txt", "-"]


def test_missing_value_is_reported():
    with pytest.raises(UsageError, match="needs a value"):
        make_parser().parse(["--name", "--verbose"])


def test_unknown_options_are_rejected():
    with pytest.raises(UsageError):
        make_parser().parse(["--colour"])
    with pytest.raises(UsageError):
        make_parser().parse(["-x"])


def test_double_dash_ends_options():
    parsed = make_parser().parse(["--verbose", "--", "--offset", "-x"])
    assert parsed.options["verbose"] is True
    assert parsed.positionals == ["--offset", "-x"]
