"""The registry's REST API: the canary/rollback workflow over HTTP, tenant isolation, the snapshot."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from serving.registry.models import Adapter, AdapterVersion, DeploymentEvent
from tenants.services import api_key_create

pytestmark = pytest.mark.django_db

BASE = "/api/v1/adapters"
SNAPSHOT = "/api/v1/internal/registry/snapshot"


@pytest.fixture
def versions_a(adapter_a, make_version):
    """support-bot of tenant A with 1.0.0, 1.1.0 and 1.2.0, all ready."""
    for text in ("1.0.0", "1.1.0", "1.2.0"):
        make_version(adapter_a, text)
    return adapter_a


def ok(response, status: int = 200) -> dict:
    assert response.status_code == status, response.content
    return response.json() if response.content else {}


def listed(response, id_key: str) -> list[dict]:
    """The rows of a whole list (one page), after checking the one list shape around them."""
    body = ok(response)
    assert set(body) == {"object", "data", "has_more", "first_id", "last_id"} and body["object"] == "list"
    rows = body["data"]
    assert (body["first_id"], body["last_id"]) == ((rows[0][id_key], rows[-1][id_key]) if rows else (None, None))
    assert body["has_more"] is False
    return rows


def walk(client, url: str, id_key: str, limit: int) -> list[dict]:
    """Every row of a list, page by page through its cursor."""
    rows, after = [], None
    while True:
        body = ok(client.get(url, {"limit": limit, **({"after": after} if after else {})}))
        assert len(body["data"]) <= limit
        rows += body["data"]
        if not body["has_more"]:
            return rows
        after = body["last_id"]


def error(response, status: int) -> dict:
    assert response.status_code == status, response.content
    body = response.json()["error"]
    assert set(body) == {"message", "type", "code", "param"}
    return body


def test_create_list_get_adapters(client_a):
    created = ok(client_a.post(BASE, {"name": "support-bot", "description": "tickets"}, format="json"), 201)
    assert created == {"name": "support-bot", "description": "tickets", "created_at": created["created_at"],
                       "active_version": None, "canary": None, "version_count": 0}
    assert [item["name"] for item in listed(client_a.get(BASE), "name")] == ["support-bot"]
    assert ok(client_a.get(f"{BASE}/support-bot/"))["name"] == "support-bot"
    assert error(client_a.post(BASE, {"name": "support-bot"}, format="json"), 409)["code"] == "adapter_exists"
    assert error(client_a.post(BASE, {"name": "Bad Name"}, format="json"), 400)["param"] == "name"
    assert error(client_a.post(BASE, {}, format="json"), 400)["param"] == "name"


def test_tier_limit_is_a_403_with_the_numbers(client_a, tenant_a):
    tier = tenant_a.tenant.tier
    tier.max_adapters = 1
    tier.save()
    ok(client_a.post(BASE, {"name": "one"}, format="json"), 201)
    body = error(client_a.post(BASE, {"name": "two"}, format="json"), 403)
    assert body["code"] == "max_adapters_reached" and "(1)" in body["message"]


def test_canary_workflow_over_http(client_a, versions_a):
    url = f"{BASE}/support-bot"
    state = ok(client_a.post(f"{url}/versions/1.0.0/deploy", {"reason": "first"}, format="json"))
    assert (state["active_version"], state["canary"]) == ("1.0.0", None)

    state = ok(client_a.post(f"{url}/canary", {"version": "1.1.0", "weight": 0.1}, format="json"))
    assert state["canary"] == {"version": "1.1.0", "weight": 0.1}
    state = ok(client_a.patch(f"{url}/canary", {"weight": 0.5, "reason": "looks good"}, format="json"))
    assert state["canary"] == {"version": "1.1.0", "weight": 0.5}
    assert error(client_a.patch(f"{url}/canary", {"weight": 2}, format="json"), 400)["param"] == "weight"
    state = ok(client_a.post(f"{url}/canary/promote", {}, format="json"))
    assert (state["active_version"], state["canary"]) == ("1.1.0", None)

    ok(client_a.post(f"{url}/canary", {"version": "1.2.0", "weight": 0.2}, format="json"))
    state = ok(client_a.post(f"{url}/canary/abort", {"reason": "errors"}, format="json"))
    assert (state["active_version"], state["canary"]) == ("1.1.0", None)
    state = ok(client_a.post(f"{url}/rollback", {}, format="json"))
    assert state["active_version"] == "1.0.0"
    assert error(client_a.post(f"{url}/rollback", {}, format="json"), 409)["code"] == "no_previous_version"

    versions = listed(client_a.get(f"{url}/versions"), "version")
    assert [(v["version"], v["status"]) for v in versions] == [
        ("1.2.0", "deprecated"), ("1.1.0", "deprecated"), ("1.0.0", "active")]
    archived = ok(client_a.post(f"{url}/versions/1.2.0/archive", {}, format="json"))
    assert archived["status"] == "archived"
    assert ok(client_a.get(f"{url}/versions/1.1.0"))["model"] == "support-bot@1.1.0"
    assert error(client_a.get(f"{url}/versions/7.0.0"), 404)["code"] == "version_not_found"

    events = listed(client_a.get(f"{url}/events"), "id")
    assert walk(client_a, f"{url}/events", "id", limit=3) == events
    assert [event["type"] for event in events] == [
        "archive", "rollback", "abort", "canary_start", "promote", "canary_weight", "canary_start", "deploy"]
    assert events[2]["reason"] == "errors" and events[5]["from_weight"] == 0.1 and events[5]["to_weight"] == 0.5
    assert all(event["actor"].startswith("api-key:") for event in events)


def test_lists_page_through_their_cursor(client_a, adapter_a, make_version):
    for text in ("1.0.0", "1.0.1", "1.1.0", "2.0.0-rc.1", "2.0.0", "10.0.0"):
        make_version(adapter_a, text)
    for name in ("alpha", "beta", "gamma"):
        ok(client_a.post(BASE, {"name": name}, format="json"), 201)
    versions = [row["version"] for row in walk(client_a, f"{BASE}/support-bot/versions", "version", limit=4)]
    assert versions == ["10.0.0", "2.0.0", "2.0.0-rc.1", "1.1.0", "1.0.1", "1.0.0"]
    names = [row["name"] for row in walk(client_a, BASE, "name", limit=2)]
    assert names == ["alpha", "beta", "gamma", "support-bot"]
    assert ok(client_a.get(BASE, {"limit": 2, "after": "beta"}))["first_id"] == "gamma"
    assert error(client_a.get(f"{BASE}/support-bot/versions", {"after": "latest"}), 400)["param"] == "after"
    assert error(client_a.get(f"{BASE}/support-bot/events", {"after": "x"}), 400)["code"] == "invalid_cursor"
    assert error(client_a.get(BASE, {"limit": 101}), 400)["param"] == "limit"


def test_refusals_are_409_with_reasons(client_a, versions_a):
    url = f"{BASE}/support-bot"
    assert error(client_a.post(f"{url}/canary", {"version": "1.1.0", "weight": 0.1}, format="json"),
                 409)["code"] == "no_active_version"
    assert error(client_a.post(f"{url}/canary/promote", {}, format="json"), 409)["code"] == "no_canary"
    ok(client_a.post(f"{url}/versions/1.0.0/deploy", {}, format="json"))
    assert error(client_a.post(f"{url}/versions/1.0.0/archive", {}, format="json"), 409)["code"] == "version_serving"
    assert error(client_a.post(f"{url}/canary", {"version": "9.9.9", "weight": 0.1}, format="json"),
                 404)["code"] == "version_not_found"


def test_delete_adapter(client_a, versions_a):
    url = f"{BASE}/support-bot"
    ok(client_a.post(f"{url}/versions/1.0.0/deploy", {}, format="json"))
    assert error(client_a.delete(url), 409)["code"] == "adapter_serving"
    assert client_a.delete(f"{url}?force=true").status_code == 204
    assert error(client_a.get(url), 404)["code"] == "adapter_not_found"
    assert DeploymentEvent.objects.filter(adapter_name="support-bot", kind="delete").count() == 1


def test_tenant_b_cannot_see_or_change_tenant_a_adapters(client_a, client_b, versions_a):
    url = f"{BASE}/support-bot"
    ok(client_a.post(f"{url}/versions/1.0.0/deploy", {}, format="json"))
    ok(client_a.post(f"{url}/canary", {"version": "1.1.0", "weight": 0.3}, format="json"))
    before = sorted(AdapterVersion.objects.values_list("version", "status", "traffic_weight"))
    events_before = DeploymentEvent.objects.count()

    assert listed(client_b.get(BASE), "name") == []
    attempts = [
        client_b.get(url),
        client_b.get(f"{url}/versions"),
        client_b.get(f"{url}/versions/1.0.0"),
        client_b.get(f"{url}/events"),
        client_b.post(f"{url}/versions/1.2.0/deploy", {}, format="json"),
        client_b.post(f"{url}/versions/1.2.0/archive", {}, format="json"),
        client_b.post(f"{url}/canary", {"version": "1.2.0", "weight": 0.5}, format="json"),
        client_b.patch(f"{url}/canary", {"weight": 0.9}, format="json"),
        client_b.post(f"{url}/canary/promote", {}, format="json"),
        client_b.post(f"{url}/canary/abort", {}, format="json"),
        client_b.post(f"{url}/rollback", {}, format="json"),
        client_b.delete(f"{url}?force=true"),
        client_b.post(f"{url}/versions", {"files": []}, format="multipart"),
    ]
    missing = error(client_b.get(f"{BASE}/no-such-adapter"), 404)
    for response in attempts:
        body = error(response, 404)
        assert body == {**missing, "message": missing["message"].replace("no-such-adapter", "support-bot")}
    assert sorted(AdapterVersion.objects.values_list("version", "status", "traffic_weight")) == before
    assert DeploymentEvent.objects.count() == events_before
    assert Adapter.objects.filter(name="support-bot").count() == 1


def test_read_only_callers_cannot_change_anything(tenant_a, versions_a):
    _, inference_key = api_key_create(tenant=tenant_a.tenant, name="inference", scopes=["inference"])
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {inference_key}")
    assert error(client.get(BASE), 403)["message"].startswith("This API key lacks the 'manage' scope")
    assert error(client.post(f"{BASE}/support-bot/versions/1.0.0/deploy", {}, format="json"), 403)
    assert not DeploymentEvent.objects.exists()


def test_unauthenticated_is_401(versions_a):
    assert error(APIClient().get(BASE), 401)


def test_session_user_is_audited_by_name(tenant_a, versions_a, django_user_model):
    from tenants.models import Membership

    user = django_user_model.objects.create_user(username="carol", password="pw-carol-123")
    Membership.objects.create(user=user, tenant=tenant_a.tenant, role=Membership.Role.MEMBER)
    client = APIClient(enforce_csrf_checks=False)
    client.force_login(user)
    ok(client.post(f"{BASE}/support-bot/versions/1.0.0/deploy", {}, format="json"))
    assert DeploymentEvent.objects.get().actor == "user:carol"


# --- the serving workers' snapshot ------------------------------------------------------------


def test_snapshot_requires_the_registry_token(settings, versions_a):
    worker = APIClient()
    settings.REGISTRY_TOKEN = ""
    assert "set REGISTRY_TOKEN" in error(worker.get(SNAPSHOT, HTTP_AUTHORIZATION="Bearer x"), 403)["message"]
    settings.REGISTRY_TOKEN = "s3cret-token"
    assert error(worker.get(SNAPSHOT), 401)
    assert error(worker.get(SNAPSHOT, HTTP_AUTHORIZATION="Bearer wrong"), 401)
    assert error(worker.get(SNAPSHOT, HTTP_AUTHORIZATION="Token s3cret-token"), 401)
    response = worker.get(SNAPSHOT, HTTP_AUTHORIZATION="Bearer s3cret-token")
    assert response.status_code == 200
    assert response.json() == {"revision": 0, "base_model": "tiny-llama", "base_model_revision": "", "adapters": []}


def test_snapshot_is_not_reachable_with_a_tenant_key(settings, client_a, versions_a):
    settings.REGISTRY_TOKEN = "s3cret-token"
    assert error(client_a.get(SNAPSHOT), 401)


def test_snapshot_follows_deployments(settings, client_a, versions_a):
    settings.REGISTRY_TOKEN = "s3cret-token"
    worker = APIClient()
    worker.credentials(HTTP_AUTHORIZATION="Bearer s3cret-token")
    url = f"{BASE}/support-bot"
    ok(client_a.post(f"{url}/versions/1.0.0/deploy", {}, format="json"))
    ok(client_a.post(f"{url}/canary", {"version": "1.1.0", "weight": 0.25}, format="json"))
    snapshot = ok(worker.get(SNAPSHOT))
    assert {(entry["name"], entry["status"], entry["weight"]) for entry in snapshot["adapters"]} == {
        ("alice-co/support-bot@1.0.0", "active", 0.75), ("alice-co/support-bot@1.1.0", "canary", 0.25)}
    ok(client_a.post(f"{url}/canary/abort", {}, format="json"))
    snapshot = ok(worker.get(SNAPSHOT))
    assert [(entry["name"], entry["weight"]) for entry in snapshot["adapters"]] == [
        ("alice-co/support-bot@1.0.0", 1.0)]
    assert snapshot["revision"] == DeploymentEvent.objects.order_by("-id").first().id


def test_openapi_schema_documents_the_registry(client_a):
    schema = APIClient().get("/api/schema/", HTTP_ACCEPT="application/json").json()
    paths = schema["paths"]
    for path in ("/api/v1/adapters", "/api/v1/adapters/{name}/canary", "/api/v1/adapters/{name}/canary/promote",
                 "/api/v1/adapters/{name}/rollback", "/api/v1/adapters/{name}/versions/{version}/deploy",
                 "/api/v1/internal/registry/snapshot"):
        assert any(key.rstrip("/") == path for key in paths), path

