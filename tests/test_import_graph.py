"""The import rules that import-linter's contracts (pyproject.toml) cannot say.

No two modules of the project import each other, directly or round a longer loop, `bench/`
included: a circle inside a package (resilience ↔ pipeline once) is a sign that something lives in
the wrong module, and a lazy import inside a function that closes a circle counts too (grimp reads
every import statement, not only the top-level ones).

No arrow climbs back up between packages: LAYERS orders them, top to bottom, and a package imports
only those below it. The arrows that still climb are listed in CLIMBING, each with why; the list
only shrinks (an arrow that is gone must leave it), and a new one fails the test.

The web process (and every `manage.py` command) loads neither torch nor transformers: they cost
each web process seconds of start-up, and a tenants command ten. The upload check reaches the
engine's adapter reader, which imports torch inside the function that reads tensors, so a static
contract would see an import that never runs; a real process is asked what it loaded instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

PACKAGES = ("kernels", "serving", "runtime", "lora_platform", "tenants", "training", "dashboard", "api")
# The benchmark scripts: a namespace package (no __init__.py), imported as `bench.<script>`.
SCRIPTS = ("bench",)

# The one circle left: bench.gateway's Platform registers adapters with bench.fleet_platform's
# helpers, which start their web processes with bench.gateway's (free_port, wait_up, bench_tenant).
KNOWN_CYCLES = [["bench.fleet_platform", "bench.gateway"]]

# Top to bottom. serving's sub-packages are layers of their own; a module belongs to the longest
# name that prefixes it.
LAYERS = ("bench", "lora_platform", "dashboard", "training", "serving.gateway", "serving.registry", "tenants", "api",
          "serving.engine", "runtime", "serving.contracts", "kernels")
# (importer's layer, imported layer): the arrows that climb, each with why. None since issue 40 took
# the last ones off (serving → training, the registry → the gateway, the engine → serving's HTTP guard).
CLIMBING: dict[tuple[str, str], str] = {}


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

    present = [name for name in PACKAGES + SCRIPTS if importlib.util.find_spec(name) is not None]
    graph = grimp.build_graph(*present, cache_dir=None)
    assert [cycle for cycle in _cycles(graph) if cycle not in KNOWN_CYCLES] == []
    assert [cycle for cycle in KNOWN_CYCLES if cycle not in _cycles(graph)] == [], "gone: take it off KNOWN_CYCLES"


def _layer(module: str) -> str | None:
    return max((name for name in LAYERS if module == name or module.startswith(name + ".")), key=len, default=None)


def _climbing(graph: grimp.ImportGraph) -> dict[tuple[str, str], list[str]]:
    """Every import from a layer to one above it, by (importer's layer, imported layer)."""
    found: dict[tuple[str, str], list[str]] = {}
    for module in sorted(graph.modules):
        below = _layer(module)
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            above = _layer(imported)
            if below and above and LAYERS.index(above) < LAYERS.index(below):
                found.setdefault((below, above), []).append(f"{module} -> {imported}")
    return found


def test_the_layer_check_sees_an_arrow_up() -> None:
    graph = grimp.ImportGraph()
    for name in ("kernels", "kernels.apply", "serving", "serving.engine", "serving.engine.llm"):
        graph.add_module(name)
    graph.add_import(importer="serving.engine.llm", imported="kernels.apply")
    assert _climbing(graph) == {}
    graph.add_import(importer="kernels.apply", imported="serving.engine.llm")
    assert _climbing(graph) == {("kernels", "serving.engine"): ["kernels.apply -> serving.engine.llm"]}


def test_no_arrow_climbs_back_up_between_packages() -> None:
    import importlib.util

    present = [name for name in PACKAGES + SCRIPTS if importlib.util.find_spec(name) is not None]
    climbing = _climbing(grimp.build_graph(*present, cache_dir=None))
    assert {pair: imports for pair, imports in climbing.items() if pair not in CLIMBING} == {}
    assert set(CLIMBING) - set(climbing) == set(), "gone: take these arrows off CLIMBING"


ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "peft", "triton")
# What a web process and a manage.py command load: the settings, every URL's view and the admin
# (the system checks import them), the ASGI application with the gateway's routes, and each of the
# project's management commands.
WEB_PROCESS = f"""
import sys

import django

django.setup()
from django.core.management import call_command, get_commands, load_command_class

call_command("check")
import lora_platform.asgi

for name, app in get_commands().items():
    if app.split(".")[0] in {PACKAGES!r}:  # the registry's app is serving.registry
        load_command_class(app, name)
print(" ".join(sorted(module for module in {HEAVY!r} if module in sys.modules)))
"""


@pytest.mark.e2e
def test_the_web_process_and_manage_commands_load_neither_torch_nor_transformers(tmp_path: Path) -> None:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "lora_platform.settings", "LORAPLEX_VAR_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", WEB_PROCESS], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "System check identified no issues" in result.stdout
    assert result.stdout.splitlines()[-1].split() == [], f"the web process loaded {result.stdout.splitlines()[-1]}"

