from humansize import format_size, parse_size


def test_small_sizes_are_bytes():
    assert format_size(0) == "0 B"
    assert format_size(1023) == "1023 B"


def test_units():
    assert format_size(1536) == "1.5 KiB"
    assert format_size(5 * 1024 ** 3) == "5.0 GiB"
    assert format_size(-2048) == "-2.0 KiB"


def test_parse():
    assert parse_size("1.5 KiB") == 1536
    assert parse_size("2mb") == 2 * 1024 ** 2
    assert parse_size("17") == 17
