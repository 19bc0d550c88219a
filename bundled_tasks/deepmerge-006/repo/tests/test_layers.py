from deepmerge import DELETE, merge


def test_nested_override_keeps_siblings():
    base = {"db": {"host": "localhost", "port": 5432}, "debug": False}
    assert merge(base, {"db": {"port": 6543}}) == {
        "db": {"host": "localhost", "port": 6543},
        "debug": False,
    }


def test_lists_are_replaced():
    assert merge({"tags": ["a", "b"]}, {"tags": ["c"]}) == {"tags": ["c"]}


def test_delete_marker_removes_key():
    assert merge({"a": 1, "b": 2}, {"b": DELETE}) == {"a": 1}
