import pytest

from cliargs import ArgParser, UsageError


def make_parser():
    p = ArgParser()
    p.add_option("offset", default=0, convert=int)
    p.add_option("scale", default=1.0, convert=float)
    return p


def test_negative_number_as_option_value():
    parsed = make_parser().parse(["--offset", "-5", "--scale", "-0.25"])
    assert parsed.options == {"offset": -5, "scale": -0.25}


def test_negative_number_as_positional():
    assert make_parser().parse(["-3", "10", "-1.5e3"]).positionals == ["-3", "10", "-1.5e3"]


def test_equals_form_with_negative_value():
    assert make_parser().parse(["--offset=-7"]).options["offset"] == -7


def test_option_word_is_still_not_a_value():
    with pytest.raises(UsageError, match="needs a value"):
        make_parser().parse(["--offset", "--scale", "2"])
