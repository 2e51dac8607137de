"""The gateway's routes in the served OpenAPI schema (serving.gateway.openapi): `/api/schema/` of a
live web process holds `/v1/chat/completions`, `/v1/completions` and `/v1/models` with their bodies,
and what that process answers on `/v1/models` (list, one model, delete, and their refusals) is what
the schema says, checked by schemathesis."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from serving.registry import services
from tests.gateway.conftest import upload_version

pytestmark = pytest.mark.django_db(transaction=True)

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


def served_schema(web) -> dict:
    response = httpx.get(f"{web.url}/api/schema/", params={"format": "json"}, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def resolve(schema: dict, node: dict) -> dict:
    while "$ref" in node:
        node = schema["components"]["schemas"][node["$ref"].rsplit("/", 1)[1]]
    return node


def test_the_schema_holds_the_gateway_routes_with_their_bodies(web):
    schema = served_schema(web)
    paths = schema["paths"]
    for path, fields in (("/v1/chat/completions", {"model", "messages", "stream", "temperature", "tools"}),
                         ("/v1/completions", {"model", "prompt", "stream", "max_tokens"})):
        operation = paths[path]["post"]
        request = resolve(schema, operation["requestBody"]["content"]["application/json"]["schema"])
        assert fields <= set(request["properties"]), (path, sorted(request["properties"]))
        reply = resolve(schema, operation["responses"]["200"]["content"]["application/json"]["schema"])
        assert {"id", "choices", "usage", "model"} <= set(reply["properties"])
        assert "text/event-stream" in operation["responses"]["200"]["content"]
        assert operation["responses"]["404"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/Error"}
    assert set(paths["/v1/models"]) == {"get"} and set(paths["/v1/models/{model}"]) == {"get", "delete"}
    delete = paths["/v1/models/{model}"]["delete"]
    assert {parameter["name"] for parameter in delete["parameters"]} == {"model", "force", "reason"}
    assert {"200", "400", "401", "403", "404", "409"} <= set(delete["responses"])
    assert delete["responses"]["200"]["content"]["application/json"]["schema"]["properties"]["deleted"] == {
        "type": "boolean"}


def test_the_models_routes_answer_as_the_schema_says(web, registry, tenant_a, adapter_dirs):
    adapter = services.adapter_create(tenant=tenant_a.tenant, name="support-bot")
    services.adapter_version_deploy(version=upload_version(adapter, adapter_dirs[0], "1.0.0"), actor="test")
    upload_version(adapter, adapter_dirs[1], "1.1.0")
    schema = schemathesis.openapi.from_url(f"{web.url}/api/schema/?format=json")
    key = {"Authorization": f"Bearer {tenant_a.key}"}
    calls = [
        ("/v1/models", "GET", {}, {}, key, 200),
        ("/v1/models/{model}", "GET", {"model": "support-bot"}, {}, key, 200),
        ("/v1/models/{model}", "GET", {"model": "no-such-bot"}, {}, key, 404),
        ("/v1/models/{model}", "DELETE", {"model": "support-bot"}, {}, key, 409),
        ("/v1/models/{model}", "DELETE", {"model": "support-bot"}, {"force": "maybe"}, key, 400),
        ("/v1/models/{model}", "DELETE", {"model": "support-bot@1.1.0"}, {"reason": "unused"}, key, 200),
        ("/v1/models/{model}", "DELETE", {"model": "support-bot"}, {}, {}, 401),
    ]
    for path, method, path_parameters, query, headers, expected in calls:
        case = schema[path][method].Case(path_parameters=path_parameters, query=query)
        response = case.call(base_url=web.url, headers=headers)
        assert response.status_code == expected, (path, method, response.text)
        case.validate_response(response, checks=CHECKS)
