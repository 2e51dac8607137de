"""The gateway's layout (docs/gateway.md, "Layout"): Django only at its edge.

import-linter's contract "the gateway's policy modules never import Django" (pyproject.toml) holds
every module of serving/gateway/ (`serving.gateway.*`), so a new module is Django-free unless it is
deliberately made an edge one. An edge module's own imports are ignored by the contract; this keeps
each such module forbidden to the policy modules too, so no chain from a policy module to Django
runs through the edge unseen.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = "the gateway's policy modules never import Django"
EDGE = {"asgi", "views", "catalog", "wiring", "model_delete", "openapi"}


def _contract() -> dict[str, list[str]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"] if c["name"] == CONTRACT]
    return contract


def test_every_gateway_module_is_held_and_only_the_edge_is_let_off() -> None:
    contract = _contract()
    assert contract["source_modules"] == ["serving.gateway.*"]
    ignored = {line.split(" -> ")[0].removeprefix("serving.gateway.") for line in contract["ignore_imports"]}
    assert ignored == EDGE, "the edge let off by the contract is not the documented one"


def test_every_edge_module_is_forbidden_to_the_policy_modules() -> None:
    forbidden = set(_contract()["forbidden_modules"])
    assert {f"serving.gateway.{name}" for name in EDGE} <= forbidden
    assert {"django", "rest_framework", "asgiref", "celery"} <= forbidden
