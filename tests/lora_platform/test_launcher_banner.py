"""`make up`'s banner says where everything is, the dashboard and the API docs included, and every
address it prints on the web app is one the web app serves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lora_platform.launcher import banner

BASE = "http://127.0.0.1:8000"


def test_the_banner_prints_the_dashboard_the_api_docs_and_the_probes() -> None:
    lines = banner(BASE, None, None).splitlines()
    assert f"  Dashboard    {BASE}/   (sign in as the admin below)" in lines
    docs = next(line for line in lines if line.startswith("  API docs"))
    for path in ("/api/docs/", "/api/redoc/", "/api/schema/"):
        assert f"{BASE}{path}" in docs
    health = next(line for line in lines if line.startswith("  Health"))
    assert f"{BASE}/healthz" in health and f"{BASE}/readyz" in health


@pytest.mark.django_db
def test_every_web_address_in_the_banner_is_served(client) -> None:
    paths = sorted(set(re.findall(re.escape(BASE) + r"(/[^\s,;)]*)", banner(BASE, None, None))))
    assert "/" in paths and "/api/redoc/" in paths
    paths.remove("/api/v1/")  # the API's prefix, not a page: its routes are below it
    for path in paths:
        status = client.get(path).status_code
        # The dashboard and the admin send a visitor to sign in; /readyz may say not ready (no worker here).
        assert status in (200, 302, 503) and (status != 503 or path == "/readyz"), (path, status)


def test_the_banner_points_at_the_demo_dataset_when_given() -> None:
    assert "Demo data" not in banner(BASE, None, None)
    lines = banner(BASE, None, None, demo_dataset=Path("/srv/loraplex/examples/demo-facts.jsonl")).splitlines()
    assert any(line.startswith("  Demo data    /srv/loraplex/examples/demo-facts.jsonl") for line in lines)
