"""The served OpenAPI schema says what the API does (docs/security.md), checked by schemathesis.

Every operation of the schema the project serves (`/api/schema/`: the management API under
`/api/v1/` and OpenAI's files and fine-tuning API under `/v1/`) gets a few generated requests,
authenticated with a tenant's key, through the WSGI app in this process. Each response must be
no 5xx, of a status the operation documents, in a documented content type, and of the documented
body (list envelopes, the error body of every 4xx).

Not run here: the gateway's routes (`/v1/chat/completions`, `/v1/completions`, `/v1/models`), in
the schema (serving.gateway.openapi) but served by the ASGI application and reading the database
from the gateway's own threads, which do not see this test's transaction; the responses of a live
web process are checked against the schema in tests/gateway/test_gateway_schema_e2e.py, and their
OpenAI shapes with OpenAI's SDK (tests/gateway/test_openai_client.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from django.core.handlers.wsgi import WSGIHandler
from django.core.signals import request_finished, request_started
from django.db import close_old_connections
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from serving.registry import services

pytestmark = pytest.mark.django_db

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


# The schema as served (GET /api/schema/ through the WSGI app), loaded when the module is collected so
# that each operation is a test of its own. (schemathesis's fixture-based lazy loader reads a pytest
# node attribute that pytest 9 no longer has.)
APP = WSGIHandler()
schema = schemathesis.openapi.from_wsgi("/api/schema/", APP).exclude(
    path_regex=r"^/v1/(chat/completions|completions|models)")


@pytest.fixture(autouse=True)
def keep_the_test_connection() -> Iterator[None]:
    # As Django's test client does: a request must not close the connection holding the test's transaction.
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    try:
        yield
    finally:
        request_started.connect(close_old_connections)
        request_finished.connect(close_old_connections)


@pytest.fixture
def seeded(tenant_a):
    """Tenant A's key, and an adapter, so that list responses are checked with a row, not only empty."""
    services.adapter_create(tenant=tenant_a.tenant, name="support-bot", description="")
    return tenant_a


@schema.parametrize()
@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture])
def test_api_matches_its_schema(case: schemathesis.Case, seeded) -> None:
    case.call_and_validate(headers={"Authorization": f"Bearer {seeded.key}"}, checks=CHECKS)
