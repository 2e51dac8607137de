"""The OpenAPI schema at /api/schema/ documents the tenant API and both ways to authenticate."""

from __future__ import annotations

import pytest
import yaml
from rest_framework.test import APIClient


@pytest.mark.django_db
def test_schema_documents_tenant_endpoints_without_warnings(capsys: pytest.CaptureFixture[str]) -> None:
    response = APIClient().get("/api/schema/")
    assert response.status_code == 200
    schema = yaml.safe_load(response.content)

    assert {"/api/v1/tenant", "/api/v1/api-keys/", "/api/v1/api-keys/{id}/"} <= set(schema["paths"])
    assert {"get", "delete"} <= set(schema["paths"]["/api/v1/api-keys/{id}/"])
    assert {"get", "post"} <= set(schema["paths"]["/api/v1/api-keys/"])
    schemes = schema["components"]["securitySchemes"]
    assert schemes["apiKey"]["scheme"] == "bearer" and schemes["session"]["in"] == "cookie"
    assert {"apiKey": []} in schema["paths"]["/api/v1/tenant"]["get"]["security"]
    # drf-spectacular reports what it could not describe on stderr, naming the source file.
    assert "tenants/" not in capsys.readouterr().err
