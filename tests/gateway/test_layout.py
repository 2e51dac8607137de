"""The gateway's layout (docs/gateway.md, "Layout"): Django only at its edge.

import-linter's contract "the gateway's policy modules never import Django" (pyproject.toml) holds
only for the modules it names; this keeps it naming every module of serving/gateway/ but the
edge modules, so a new module is Django-free unless it is deliberately made an edge one.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = "the gateway's policy modules never import Django"
EDGE = {"asgi", "views", "catalog", "wiring", "model_delete", "openapi"}


def test_every_gateway_module_but_the_edge_is_held_django_free() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"] if c["name"] == CONTRACT]
    named = {name.removeprefix("serving.gateway.") for name in contract["source_modules"]}
    modules = {path.stem for path in (ROOT / "serving" / "gateway").glob("*.py")} - {"__init__"}
    assert modules - EDGE - named == set(), "gateway modules neither named Django-free nor edge"
    assert named & EDGE == set() and named <= modules, "the contract names edge or missing modules"
    assert {"django", "serving.gateway.catalog", "serving.gateway.wiring"} <= set(contract["forbidden_modules"])
