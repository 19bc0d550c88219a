from humansize import format_size


def test_value_that_rounds_up_moves_to_next_unit():
    assert format_size(1024 ** 2 - 1) == "1.0 MiB"
    assert format_size(1024 ** 3 - 1) == "1.0 GiB"


def test_rounding_boundary_depends_on_precision():
    assert format_size(1024 ** 2 - 60, precision=0) == "1 MiB"
    assert format_size(1024 * 1023 + 1000) == "1.0 MiB"


def test_more_precision_keeps_smaller_unit():
    assert format_size(1024 ** 2 - 1, precision=3) == "1023.999 KiB"
    assert format_size(1024 * 1023 + 900) == "1023.9 KiB"
