from envsubst import expand


def test_colon_dash_uses_default_for_empty_value():
    assert expand("${HOST:-localhost}", {"HOST": ""}) == "localhost"


def test_colon_dash_in_longer_template():
    env = {"SCHEME": "", "HOST": "example.org", "PORT": ""}
    template = "${SCHEME:-https}://${HOST:-localhost}:${PORT:-443}/"
    assert expand(template, env) == "https://example.org:443/"


def test_colon_dash_keeps_non_empty_value():
    assert expand("${LEVEL:-info}", {"LEVEL": "debug"}) == "debug"
