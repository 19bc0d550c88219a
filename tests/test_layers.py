"""Imports only go down and nothing imports itself in a circle, read from the source with ast.

Layers (lowest first): ``native_io`` (I/O, framing, wire messages, errors) < ``client`` (what a
trainer imports) and ``daemon`` (the node and router processes and their runtime packages), side
by side and never importing each other < ``cli`` (the ``rolloutd`` command, which starts daemons
and asks them through the client). Inside ``daemon``: ``common`` < the runtime packages
(``sandbox``, ``sessions``, ``pipeline``, ...) < the processes ``node`` and ``router``, which never
import each other. Every import counts, at module level or inside a function, and under
``TYPE_CHECKING`` too: a circle there is still a circle a reader has to untangle.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("native_io", "client", "daemon", "cli")

RUNTIME = frozenset({"sandbox", "sessions", "pipeline", "agents", "tasks", "inference", "policy",
                     "openai_proxy", "gateway"})
PROCESSES = frozenset({"node", "router"})

ALLOWED: dict[str, frozenset[str]] = {
    "native_io": frozenset({"native_io"}),
    "client": frozenset({"native_io", "client"}),
    "daemon": frozenset({"native_io", "daemon"}),
    "cli": frozenset(PACKAGES),
}
"""Which top-level packages each may import."""

CLIENT_USERS = {
    "daemon.gateway": "the gateway is a process of its own in front of node daemons or a router, "
                      "and reaches them through the client exactly as a trainer does",
}
"""Parts of ``daemon`` that are themselves clients of a node, and so may import ``client``."""


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def source_modules() -> dict[str, Path]:
    """Every module of the four packages, named without the ``rolloutd.`` prefix."""
    found: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            found[_module_name(path)] = path
    return found


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> Iterator[tuple[str, int]]:
    """(imported module, line) for every import of a project module in ``path``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name.removeprefix("rolloutd.") for a in node.names if a.name.startswith("rolloutd.")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            elif (node.module or "").startswith("rolloutd."):
                mod = node.module.removeprefix("rolloutd.")
            else:
                continue
            # ``from pkg import sub`` imports the submodule when there is one, else a name of pkg.
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # ``import rolloutd.x.y.name`` -> module x.y
                target = target.rpartition(".")[0]
            if target:
                yield target, node.lineno


def import_graph() -> dict[str, dict[str, int]]:
    modules = source_modules()
    return {name: dict(imports_of(name, path, modules)) for name, path in modules.items()}


def _area(module: str) -> str:
    """``daemon.node.supervisor`` -> ``daemon.node``; ``client.wire`` -> ``client``."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "daemon" and len(parts) > 1 else parts[0]


def layer_violations(graph: dict[str, dict[str, int]]) -> list[str]:
    out = []
    for src, targets in graph.items():
        top, area = src.split(".")[0], _area(src)
        for dst, line in targets.items():
            dtop, darea = dst.split(".")[0], _area(dst)
            why = None
            if dtop not in ALLOWED[top] and not (dtop == "client" and area in CLIENT_USERS):
                why = f"{top} may not import {dtop}"
            elif top == "daemon" and dtop == "daemon" and area != darea:
                sub, dsub = area.partition(".")[2], darea.partition(".")[2]
                if sub in PROCESSES and dsub in PROCESSES:
                    why = "the node and the router are separate processes and never import each other"
                elif sub in RUNTIME and dsub in PROCESSES:
                    why = f"the runtime package daemon.{sub} sits below the processes"
                elif sub == "common" and dsub:
                    why = "daemon.common sits below every other part of the daemon"
                elif sub == "router" and dsub in RUNTIME:
                    why = "the router only moves messages; it runs nothing of a rollout"
            if why:
                out.append(f"{src} (line {line}) imports {dst}: {why}")
    return out


def circles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def part_graph(graph: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """The import graph between parts (``daemon.sandbox``, ``client``...): one edge per pair."""
    parts: dict[str, dict[str, int]] = {}
    for src, targets in graph.items():
        edges = parts.setdefault(_area(src), {})
        for dst, line in targets.items():
            if _area(dst) != _area(src):
                edges.setdefault(_area(dst), line)
    return parts


def test_the_graph_is_read() -> None:
    """The reader finds the imports it judges: a known edge of each kind is there."""
    graph = import_graph()
    assert "native_io.wire" in graph["daemon.node.supervisor"]
    assert "native_io.trajectory" in graph["client.rollout_calls"]
    assert "daemon.node.supervisor" in graph["cli.node"]
    assert len(graph) > 80


def test_imports_only_go_down() -> None:
    assert layer_violations(import_graph()) == []


def test_no_import_circle() -> None:
    assert circles(import_graph()) == []


def test_no_circle_between_parts() -> None:
    """A part whose modules import another part that imports it back (daemon.sandbox's pool and
    daemon.sessions' kernel, say) is one tangle a reader cannot take apart, even without a module
    circle."""
    assert circles(part_graph(import_graph())) == []


def test_a_circle_between_parts_is_caught() -> None:
    graph = import_graph()
    graph["daemon.sessions.ipython"] = {**graph["daemon.sessions.ipython"], "daemon.sandbox.base": 1}
    graph["daemon.sandbox.pool"] = {**graph["daemon.sandbox.pool"], "daemon.sessions.ipython": 1}
    assert ["daemon.sandbox", "daemon.sessions"] in circles(part_graph(graph))


@pytest.mark.parametrize(("src", "dst", "expected"), [
    ("client.async_client", "daemon.node.config", "client may not import daemon"),
    ("native_io.shm", "client.async_client", "native_io may not import client"),
    ("daemon.node.worker", "client.sync_client", "daemon may not import client"),
    ("daemon.router.router", "daemon.node.supervisor", "never import each other"),
    ("daemon.sandbox.pool", "daemon.node.config", "sits below the processes"),
])
def test_a_wrong_import_is_caught(src: str, dst: str, expected: str) -> None:
    """Each rule bites: the real graph plus one import that breaks it is refused, naming it."""
    graph = import_graph()
    graph[src] = {**graph[src], dst: 1}
    (violation,) = layer_violations(graph)
    assert violation.startswith(f"{src} (line 1) imports {dst}") and expected in violation


def test_a_circle_is_caught() -> None:
    graph = import_graph()
    graph["native_io.framing"] = {**graph["native_io.framing"], "native_io.wire": 1}
    assert ["native_io.framing", "native_io.wire"] in circles(graph)


MODULE_MAX_LINES = 500
CLASS_MAX_LINES = 250


def oversized(path: Path) -> list[str]:
    """Modules over MODULE_MAX_LINES and classes over CLASS_MAX_LINES lines in ``path``."""
    source = path.read_text()
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    found = [f"{where}: {n} lines" for n in [len(source.splitlines())] if n > MODULE_MAX_LINES]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
            n = node.end_lineno - node.lineno + 1
            if n > CLASS_MAX_LINES:
                found.append(f"{where}: class {node.name} {n} lines")
    return found


def test_modules_and_classes_stay_small() -> None:
    """One job per module and per class: the sizes that say it."""
    assert [f for path in source_modules().values() for f in oversized(path)] == []


def test_a_big_class_is_caught(tmp_path: Path) -> None:
    big = tmp_path / "big.py"
    big.write_text("class Big:\n" + "    x = 1\n" * CLASS_MAX_LINES)
    assert oversized(big) == [f"{big}: class Big {CLASS_MAX_LINES + 1} lines"]
