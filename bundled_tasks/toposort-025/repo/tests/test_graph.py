from buildorder import layers, topo_order


def test_diamond():
    graph = {"app": ["net", "db"], "net": ["core"], "db": ["core"]}
    assert topo_order(graph) == ["core", "db", "net", "app"]


def test_unlisted_dependencies_are_steps():
    assert topo_order({"b": ["a"]}) == ["a", "b"]
    assert topo_order({}) == []


def test_layers():
    graph = {"app": ["net", "db"], "net": ["core"], "db": ["core"], "docs": []}
    assert layers(graph) == [["core", "docs"], ["db", "net"], ["app"]]
