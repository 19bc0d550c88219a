import pytest

from buildorder import CycleError, layers, topo_order


def test_cycle_is_reported():
    graph = {"a": ["b"], "b": ["c"], "c": ["a"], "d": []}
    with pytest.raises(CycleError) as info:
        topo_order(graph)
    assert sorted(info.value.nodes) == ["a", "b", "c"]


def test_self_dependency_is_a_cycle():
    with pytest.raises(CycleError):
        topo_order({"x": ["x"]})


def test_layers_report_cycle():
    with pytest.raises(CycleError):
        layers({"lib": ["app"], "app": ["lib"]})


def test_cycle_error_is_a_value_error():
    assert issubclass(CycleError, ValueError)
    assert topo_order({"z": [], "y": ["z"]}) == ["z", "y"]
