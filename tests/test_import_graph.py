"""No two modules of the project import each other, directly or round a longer loop.

import-linter's contracts (pyproject.toml) hold the direction between packages; this holds the
rest: a circle inside a package (resilience ↔ pipeline once) is a sign that something lives in the
wrong module, and a lazy import inside a function that closes a circle counts too (grimp reads
every import statement, not only the top-level ones).
"""

from __future__ import annotations

import grimp

PACKAGES = ("kernels", "serving", "lora_platform", "tenants", "training", "dashboard", "api")


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    modules = sorted(graph.modules)
    edges = {m: sorted(n for n in graph.find_modules_directly_imported_by(m) if n in graph.modules) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in modules:
        if root in index:
            continue
        work = [(root, iter(edges[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(edges[child])))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_the_cycle_finder_sees_a_circle() -> None:
    graph = grimp.ImportGraph()
    for name in ("a", "a.x", "a.y", "a.z"):
        graph.add_module(name)
    graph.add_import(importer="a.x", imported="a.y")
    graph.add_import(importer="a.y", imported="a.z")
    graph.add_import(importer="a.z", imported="a.x")
    assert _cycles(graph) == [["a.x", "a.y", "a.z"]]


def test_no_module_imports_round_a_circle() -> None:
    import importlib.util

    present = [name for name in PACKAGES if importlib.util.find_spec(name) is not None]
    graph = grimp.build_graph(*present, cache_dir=None)
    assert _cycles(graph) == []
