import copy

from deepmerge import DELETE, merge


def test_layers_are_not_modified():
    defaults = {"server": {"port": 80, "tls": {"enabled": False}}}
    user = {"server": {"port": 8080, "tls": {"enabled": True}}}
    snapshot = copy.deepcopy(defaults), copy.deepcopy(user)
    merge(defaults, user)
    assert (defaults, user) == snapshot


def test_repeated_merges_are_independent():
    defaults = {"log": {"level": "info"}}
    first = merge(defaults, {"log": {"file": "a.log"}})
    second = merge(defaults, {"log": {"level": "debug"}})
    assert first == {"log": {"level": "info", "file": "a.log"}}
    assert second == {"log": {"level": "debug"}}


def test_mutating_result_leaves_inputs_alone():
    defaults = {"paths": {"home": "/home"}}
    result = merge(defaults)
    result["paths"]["home"] = "/tmp"
    assert defaults["paths"]["home"] == "/home"


def test_delete_nested_key():
    assert merge({"a": {"x": 1, "y": 2}}, {"a": {"y": DELETE}}) == {"a": {"x": 1}}
