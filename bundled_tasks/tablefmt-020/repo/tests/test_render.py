import pytest

from tablefmt import render_table


def test_values_wider_than_headers():
    assert render_table(["name", "n"], [["alpha", 1], ["b", 22]]) == (
        "name    n\n"
        "-----  --\n"
        "alpha   1\n"
        "b      22"
    )


def test_floats_and_missing_values():
    assert render_table(["k", "v"], [["x", 1.5], ["yy", None]], sep=" | ") == (
        "k  |    v\n"
        "-- | ----\n"
        "x  | 1.50\n"
        "yy |"
    )


def test_row_length_is_checked():
    with pytest.raises(ValueError, match="row 1"):
        render_table(["a", "b"], [[1, 2], [3]])
