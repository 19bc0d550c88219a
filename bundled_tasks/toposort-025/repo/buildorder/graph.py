"""Ordering build steps by their dependencies."""
import heapq
from collections.abc import Iterable, Mapping


class CycleError(ValueError):
    """The dependency graph has a cycle; *nodes* are the steps that could not be ordered."""

    def __init__(self, nodes: list[str]) -> None:
        super().__init__(f"dependency cycle among: {', '.join(nodes)}")
        self.nodes = nodes


def topo_order(graph: Mapping[str, Iterable[str]]) -> list[str]:
    """All steps, each after the steps it depends on.

    *graph* maps a step to the steps it depends on; dependencies that are
    not keys are steps without dependencies. Among steps that are ready at
    the same time the alphabetically first comes first, so the result is
    deterministic. Raises CycleError if the steps cannot be ordered.
    """
    deps: dict[str, set[str]] = {step: set(ds) for step, ds in graph.items()}
    for ds in list(deps.values()):
        for dep in ds:
            deps.setdefault(dep, set())
    dependents: dict[str, list[str]] = {step: [] for step in deps}
    for step, ds in deps.items():
        for dep in ds:
            dependents[dep].append(step)
    waiting = {step: len(ds) for step, ds in deps.items()}
    ready = [step for step, count in waiting.items() if count == 0]
    heapq.heapify(ready)
    order: list[str] = []
    while ready:
        step = heapq.heappop(ready)
        order.append(step)
        for dependent in dependents[step]:
            waiting[dependent] -= 1
            if waiting[dependent] == 0:
                heapq.heappush(ready, dependent)
    return order


def layers(graph: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Group steps into layers that can run in parallel: layer n only needs layers < n."""
    depth: dict[str, int] = {}
    for step in topo_order(graph):
        depth[step] = 1 + max((depth[dep] for dep in graph.get(step, ())), default=-1)
    result: list[list[str]] = [[] for _ in range(max(depth.values(), default=-1) + 1)]
    for step in sorted(depth):
        result[depth[step]].append(step)
    return result
