"""The management API seen by two tenants: can bob's tenant see, use or revoke alice's keys?"""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from rest_framework.test import APIClient

from tenants.models import ApiKey, Membership
from tenants.services import api_key_create, api_key_revoke, tenant_suspend

pytestmark = pytest.mark.django_db


def error_of(response) -> dict:
    assert response["Content-Type"].startswith("application/json"), response.content[:200]
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "code"} <= set(body["error"])
    return body["error"]


def test_tenant_endpoint_shows_the_callers_tenant_and_tier_limits(client_a, tenant_a) -> None:
    response = client_a.get("/api/v1/tenant")
    assert response.status_code == 200
    body = response.json()
    assert body["slug"] == "alice-co" and body["status"] == "active"
    assert body["tier"] == {
        "name": "standard", "requests_per_minute": 200, "tokens_per_minute": 51_200, "max_tokens_per_request": 256,
        "priority": 1, "max_concurrent_training_jobs": 2, "max_gpus_per_job": 1, "max_adapters": 20,
        "degradation_allowed": True,
    }


def test_create_list_read_and_revoke_own_keys(client_a, tenant_a) -> None:
    created = client_a.post("/api/v1/api-keys", {"name": "ci", "scopes": ["inference"]}, format="json")
    assert created.status_code == 201
    key = created.json()
    assert key["key"].startswith(f"lp-{key['prefix']}.") and key["scopes"] == ["inference"]

    listed = client_a.get("/api/v1/api-keys").json()
    assert listed["object"] == "list" and not listed["has_more"]
    assert listed["first_id"] == key["id"] and listed["last_id"] == listed["data"][-1]["id"]
    listed = listed["data"]
    assert [row["name"] for row in listed] == ["ci", "default"]
    assert all("key" not in row and "secret_hash" not in row for row in listed)
    assert client_a.get(f"/api/v1/api-keys/{key['id']}").json()["name"] == "ci"

    revoked = client_a.delete(f"/api/v1/api-keys/{key['id']}")
    assert revoked.status_code == 204 and revoked.content == b""  # as the schema says (issue 37, item 8)
    assert client_a.get(f"/api/v1/api-keys/{key['id']}").json()["revoked_at"] is not None
    refused = APIClient().get("/api/v1/tenant", HTTP_AUTHORIZATION=f"Bearer {key['key']}")
    assert refused.status_code == 401 and "revoked" in error_of(refused)["message"]


def test_tenant_b_cannot_list_read_or_revoke_tenant_a_keys(client_a, client_b, tenant_a, tenant_b) -> None:
    a_key = ApiKey.objects.get(tenant=tenant_a.tenant)

    listed = client_b.get("/api/v1/api-keys").json()["data"]
    assert [row["prefix"] for row in listed] == [ApiKey.objects.get(tenant=tenant_b.tenant).prefix]
    read = client_b.get(f"/api/v1/api-keys/{a_key.id}")
    assert read.status_code == 404 and error_of(read)["code"] == "not_found"
    revoke = client_b.delete(f"/api/v1/api-keys/{a_key.id}")
    assert revoke.status_code == 404 and error_of(revoke)["type"] == "invalid_request_error"

    a_key.refresh_from_db()
    assert a_key.revoked_at is None
    assert client_a.get("/api/v1/tenant").status_code == 200


def test_stored_hash_never_equals_or_contains_the_secret(client_a) -> None:
    full_key = client_a.post("/api/v1/api-keys", {"name": "x"}, format="json").json()["key"]
    secret = full_key.split(".", 1)[1]
    row = ApiKey.objects.get(name="x")
    for field in ApiKey._meta.concrete_fields:
        stored = str(getattr(row, field.attname))
        assert secret not in stored and full_key not in stored
    assert row.secret_hash != secret


def test_suspended_tenant_keys_get_403_saying_so(client_a, client_b, tenant_a) -> None:
    tenant_suspend(slug="alice-co")
    response = client_a.get("/api/v1/tenant")
    assert response.status_code == 403
    error = error_of(response)
    assert "suspended" in error["message"] and error["type"] == "permission_error"
    assert client_b.get("/api/v1/tenant").status_code == 200


@pytest.mark.parametrize("header", [
    "lp-abc.def",  # no scheme
    "Token lp-abc.def",
    "Bearer",
    "Bearer lp-abcdef",  # no dot
    "Bearer sk-abc.def",  # not a Loraplex key
    "Bearer lp-abc.def extra",
    "Basic dXNlcjpwYXNz",
])
def test_malformed_authorization_header_gets_401_json(header: str, tenant_a) -> None:
    response = APIClient().get("/api/v1/tenant", HTTP_AUTHORIZATION=header)
    assert response.status_code == 401
    error = error_of(response)
    assert "Malformed" in error["message"] and error["code"] == "invalid_api_key"


def test_unknown_key_and_wrong_secret_get_401(tenant_a) -> None:
    prefix = ApiKey.objects.get(tenant=tenant_a.tenant).prefix
    for key in ("lp-000000000000.secret", f"lp-{prefix}.wrong-secret"):
        response = APIClient().get("/api/v1/tenant", HTTP_AUTHORIZATION=f"Bearer {key}")
        assert response.status_code == 401
        assert error_of(response)["message"] == "Incorrect API key provided."
    response = APIClient().get("/api/v1/tenant")
    assert response.status_code == 401 and response["WWW-Authenticate"].startswith("Bearer")
    error_of(response)


def test_inference_only_key_cannot_use_the_management_api(tenant_a) -> None:
    _, key = api_key_create(tenant=tenant_a.tenant, name="gateway", scopes=["inference"])
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    for response in (client.get("/api/v1/tenant"), client.get("/api/v1/api-keys"),
                     client.post("/api/v1/api-keys", {"name": "escalate"}, format="json"),
                     client.get("/v1/files"), client.get("/v1/fine_tuning/jobs")):
        assert response.status_code == 403 and "'manage' scope" in error_of(response)["message"]
        # The code the gateway's /v1 completion routes give a key without the scope, on every surface.
        assert error_of(response)["code"] == "insufficient_scope"
    assert not ApiKey.objects.filter(name="escalate").exists()


@pytest.mark.parametrize("payload, param", [
    ({"name": ""}, "name"),
    ({"name": "x" * 101}, "name"),
    ({"name": "k", "scopes": ["admin"]}, "scopes"),
    ({"name": "k", "scopes": []}, "scopes"),
    ({}, "name"),
])
def test_bad_key_creation_input_is_a_400_naming_the_field(client_a, payload: dict, param: str) -> None:
    response = client_a.post("/api/v1/api-keys", payload, format="json")
    assert response.status_code == 400
    error = error_of(response)
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert ApiKey.objects.count() == 1


def member_client(tenant, role: str, *, enforce_csrf: bool = False) -> APIClient:
    user = get_user_model().objects.create_user(username=f"{role}@{tenant.slug}", password="pw-not-used")
    Membership.objects.create(user=user, tenant=tenant, role=role)
    client = APIClient(enforce_csrf_checks=enforce_csrf)
    client.force_login(user)
    return client


def test_session_owner_reads_and_writes_keys_for_their_tenant(tenant_a, tenant_b) -> None:
    # Owners only: a member's session is refused (tests/tenants/test_api_key_permissions.py).
    client = member_client(tenant_a.tenant, Membership.Role.OWNER)
    assert client.get("/api/v1/tenant").json()["slug"] == "alice-co"
    created = client.post("/api/v1/api-keys", {"name": "from-dashboard"}, format="json")
    assert created.status_code == 201
    assert ApiKey.objects.get(name="from-dashboard").tenant == tenant_a.tenant
    b_key = ApiKey.objects.get(tenant=tenant_b.tenant)
    assert client.delete(f"/api/v1/api-keys/{b_key.id}").status_code == 404


def test_session_writes_need_the_csrf_token(tenant_a) -> None:
    client = member_client(tenant_a.tenant, Membership.Role.OWNER, enforce_csrf=True)
    response = client.post("/api/v1/api-keys", {"name": "csrf"}, format="json")
    assert response.status_code == 403 and "CSRF" in error_of(response)["message"]
    assert not ApiKey.objects.filter(name="csrf").exists()


def test_viewer_reads_but_cannot_write(tenant_a) -> None:
    client = member_client(tenant_a.tenant, Membership.Role.VIEWER)
    key = ApiKey.objects.get(tenant=tenant_a.tenant)
    assert client.get("/api/v1/api-keys").status_code == 200
    for response in (client.post("/api/v1/api-keys", {"name": "v"}, format="json"),
                     client.delete(f"/api/v1/api-keys/{key.id}")):
        assert response.status_code == 403 and "read-only" in error_of(response)["message"]
    key.refresh_from_db()
    assert key.revoked_at is None and ApiKey.objects.count() == 1


def test_session_without_membership_or_of_a_suspended_tenant_is_refused(tenant_a) -> None:
    loner = get_user_model().objects.create_user(username="loner")
    client = APIClient()
    client.force_login(loner)
    response = client.get("/api/v1/tenant")
    assert response.status_code == 403 and "not a member" in error_of(response)["message"]

    member = member_client(tenant_a.tenant, Membership.Role.OWNER)
    tenant_suspend(slug="alice-co")
    response = member.get("/api/v1/tenant")
    assert response.status_code == 403 and "suspended" in error_of(response)["message"]


def test_revoking_is_idempotent(tenant_a) -> None:
    key = ApiKey.objects.get(tenant=tenant_a.tenant)
    first = api_key_revoke(api_key=key).revoked_at
    assert api_key_revoke(api_key=key).revoked_at == first
