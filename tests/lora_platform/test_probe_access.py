"""Issue 37, item 7: the web `/readyz` and the serving worker's `/metrics` show no tenant names or
internal addresses to an anonymous caller on the network. `/readyz` keeps its status code and its
`failing` for every caller (load balancers probe it) and gives each check's detail and error only to
a caller on this machine or with the operator's key; the worker's `/metrics` (adapter labels are
`<tenant>/<adapter>@<version>`) answers the operator's key or a loopback peer only
(docs/operations.md, "Who may read the probes and metrics")."""

from __future__ import annotations

import pytest
from django.test import Client
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from fastapi.testclient import TestClient

from lora_platform import health
from serving.engine.server.auth import OperatorAuth
from serving.engine.server.errors import install_error_handlers

KEY = "operator-key-for-tests"
REMOTE = "203.0.113.9"


@pytest.fixture
def readiness(monkeypatch):
    """Checks whose details name what an outsider must not learn: a worker's address, a Celery host."""
    checks = (health.Check("serving_workers", lambda: "1 live: worker-10.0.3.7:8100"),
              health.Check("celery", _failing, required=False))
    real = health.readiness
    monkeypatch.setattr(health, "readiness", lambda: real(checks))


def _failing() -> str:
    raise health.CheckFailed("no Celery worker answered: celery@build-host-3.internal is away")


def test_readyz_gives_details_only_to_a_local_caller_or_the_operators_key(readiness, settings):
    settings.SERVING_WORKER_API_KEY = KEY
    anonymous = Client(REMOTE_ADDR=REMOTE).get("/readyz")
    assert anonymous.status_code == 200
    body = anonymous.json()
    assert body["status"] == "ready" and body["failing"] == []
    assert body["checks"]["serving_workers"].keys() == {"ok", "required", "seconds"}
    assert body["checks"]["celery"]["ok"] is False and "error" not in body["checks"]["celery"]
    assert "10.0.3.7" not in anonymous.content.decode() and "build-host" not in anonymous.content.decode()
    for wrong in ("Bearer wrong", f"Basic {KEY}", KEY):
        refused = Client(REMOTE_ADDR=REMOTE).get("/readyz", HTTP_AUTHORIZATION=wrong)
        assert "10.0.3.7" not in refused.content.decode(), wrong

    for caller in (Client(REMOTE_ADDR="127.0.0.1"), Client(REMOTE_ADDR="::1")):
        assert caller.get("/readyz").json()["checks"]["serving_workers"]["detail"] == "1 live: worker-10.0.3.7:8100"
    keyed = Client(REMOTE_ADDR=REMOTE).get("/readyz", HTTP_AUTHORIZATION=f"bearer {KEY}").json()
    assert "build-host-3.internal" in keyed["checks"]["celery"]["error"]


def test_without_an_operator_key_no_remote_caller_reads_readyz_details(readiness, settings):
    settings.SERVING_WORKER_API_KEY = ""
    body = Client(REMOTE_ADDR=REMOTE).get("/readyz", HTTP_AUTHORIZATION="Bearer ").json()
    assert "detail" not in body["checks"]["serving_workers"]


def _worker_app(api_key: str | None) -> FastAPI:
    """The worker's middleware as app.py installs it, around a /metrics that names a tenant's adapter."""
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(OperatorAuth, api_key=api_key)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse('loraplex_lora_resident{adapter="acme/support-bot@1.0.0",tier="gpu"} 1.0\n')

    @app.get("/health")
    async def alive() -> dict[str, str]:
        return {"status": "alive"}

    return app


def test_the_workers_metrics_need_the_operators_key_from_the_network():
    remote = TestClient(_worker_app(KEY), client=(REMOTE, 40000))
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        refused = remote.get("/metrics", headers=headers)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key", headers
        assert "acme" not in refused.text
    assert remote.get("/metrics", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert remote.get("/health").status_code == 200  # probes stay open
    for address in ("127.0.0.1", "::1"):  # a scraper on the worker's machine
        assert TestClient(_worker_app(KEY), client=(address, 40000)).get("/metrics").status_code == 200
