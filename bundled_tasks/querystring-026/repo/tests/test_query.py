from querystr import build_query, parse_query


def test_repeated_keys_and_plus_as_space():
    assert parse_query("?tag=a&tag=b&q=hello+world") == {"tag": ["a", "b"], "q": ["hello world"]}


def test_blank_values():
    assert parse_query("a=&b&c=1") == {"a": [""], "b": [""], "c": ["1"]}
    assert parse_query("a=&b&c=1", keep_blank=False) == {"c": ["1"]}


def test_percent_escapes():
    assert parse_query("name=J%C3%BCrgen&path=%2Ftmp%2Fx") == {"name": ["Jürgen"], "path": ["/tmp/x"]}


def test_build_query():
    assert build_query({"q": "a b", "tag": ["x", "y"]}) == "q=a+b&tag=x&tag=y"
