import pytest

from inifile import IniError, get_int, parse_ini

SAMPLE = """
# service settings
[server]
Host = example.org
port: 8080

[paths]
; quoted values keep inner spaces
data = " /var/lib/app "
"""


def test_sections_keys_and_both_delimiters():
    config = parse_ini(SAMPLE)
    assert config["server"] == {"host": "example.org", "port": "8080"}
    assert config["paths"]["data"] == " /var/lib/app "
    assert get_int(config, "server", "port", 80) == 8080
    assert get_int(config, "server", "workers", 4) == 4


def test_key_outside_section():
    with pytest.raises(IniError, match="line 1"):
        parse_ini("a = 1\n[s]\n")


def test_line_without_delimiter():
    with pytest.raises(IniError, match="line 2"):
        parse_ini("[s]\njust words\n")
