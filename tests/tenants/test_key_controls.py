"""An API key's own controls (docs/keys.md) in the services and the REST API: each value's rule and
its error, the allow-list's matching, the audit log of every change, and an expired key refused by
the management API."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from rest_framework.test import APIClient

from serving.contracts.errors import Conflict, InvalidInput
from tenants.key_controls import model_allowed
from tenants.models import ApiKey, TenantEvent
from tenants.services import api_key_create, api_key_revoke, api_key_update

pytestmark = pytest.mark.django_db

BASE = ["tiny-llama", "example-org/tiny-llama-chat"]


def test_an_empty_allow_list_allows_everything_and_a_name_its_versions_only():
    assert model_allowed([], "anything", base_model_ids=BASE)
    allowed = ["support-bot", "sql-bot@2.0.0"]
    assert model_allowed(allowed, "support-bot", base_model_ids=BASE)
    assert model_allowed(allowed, "support-bot@1.0.3", base_model_ids=BASE)
    assert model_allowed(allowed, "sql-bot@2.0.0", base_model_ids=BASE)
    assert not model_allowed(allowed, "sql-bot", base_model_ids=BASE)
    assert not model_allowed(allowed, "sql-bot@2.0.1", base_model_ids=BASE)
    assert not model_allowed(allowed, "tiny-llama", base_model_ids=BASE)
    assert not model_allowed(allowed, "support-bot-2", base_model_ids=BASE)
    # Any name of the base model allows it by all its names.
    assert model_allowed(["example-org/tiny-llama-chat"], "tiny-llama", base_model_ids=BASE)


@pytest.mark.parametrize(("controls", "code", "param", "says"), [
    ({"requests_per_minute": 201}, "key_limit_above_tier", "requests_per_minute", "'standard' tier's requests"),
    ({"tokens_per_minute": 51_201}, "key_limit_above_tier", "tokens_per_minute", "(51200)"),
    ({"requests_per_minute": 0}, "invalid_key_limit", "requests_per_minute", "at least 1"),
    ({"monthly_token_budget": -5}, "invalid_key_limit", "monthly_token_budget", "at least 1"),
    ({"monthly_token_budget": "lots"}, "invalid_key_limit", "monthly_token_budget", "whole number"),
    ({"monthly_token_budget": 10**16}, "invalid_key_limit", "monthly_token_budget", "largest budget"),
    ({"allowed_models": ["a b"]}, "invalid_allowed_models", "allowed_models", "without spaces"),
    ({"allowed_models": ["a@1@2"]}, "invalid_allowed_models", "allowed_models", "one '@'"),
    ({"allowed_models": "support-bot"}, "invalid_allowed_models", "allowed_models", "must be a list"),
    ({"allowed_models": [f"m{n}" for n in range(101)]}, "invalid_allowed_models", "allowed_models", "at most 100"),
    ({"expires_at": "tomorrow"}, "invalid_expiry", "expires_at", "date and time"),
    ({"colour": "red"}, "unknown_key_control", "colour", "the controls are"),
])
def test_each_bad_control_is_refused_naming_it(tenant_a, controls, code, param, says):
    with pytest.raises(InvalidInput) as raised:
        api_key_create(tenant=tenant_a.tenant, name="limited", controls=controls)
    assert (raised.value.code, raised.value.param) == (code, param)
    assert says in raised.value.message
    assert ApiKey.objects.filter(name="limited").count() == 0


def test_an_expiry_in_the_past_is_refused_revoke_instead(tenant_a):
    with pytest.raises(InvalidInput, match="not in the future; to stop a key now, revoke it"):
        api_key_create(tenant=tenant_a.tenant, name="late", controls={"expires_at": timezone.now()})


def test_controls_are_kept_normalised_and_every_change_is_audited(tenant_a):
    expiry = timezone.now() + timedelta(days=30)
    key, _ = api_key_create(tenant=tenant_a.tenant, name="ci", actor="user:olivia", reason="for the CI", controls={
        "expires_at": expiry, "allowed_models": [" support-bot ", "support-bot", "sql-bot@1.0.0"],
        "requests_per_minute": 20, "monthly_token_budget": 1_000_000})
    key.refresh_from_db()
    assert key.allowed_models == ["support-bot", "sql-bot@1.0.0"]
    assert (key.expires_at, key.requests_per_minute, key.tokens_per_minute) == (expiry, 20, None)
    created = TenantEvent.objects.get(kind="key_create", subject__endswith="(ci)")
    assert (created.actor, created.reason, created.subject) == ("user:olivia", "for the CI", f"lp-{key.prefix}… (ci)")
    assert created.changes["requests_per_minute"] == [None, 20]
    assert created.changes["expires_at"] == [None, expiry.isoformat()]

    api_key_update(api_key=key, controls={"requests_per_minute": 20, "tokens_per_minute": 5_000,
                                          "allowed_models": []}, actor="api-key:abc", reason="more room")
    key.refresh_from_db()
    assert (key.tokens_per_minute, key.allowed_models) == (5_000, [])
    updated = TenantEvent.objects.get(kind="key_update")
    # Only what changed: rpm was already 20.
    assert updated.changes == {"tokens_per_minute": [None, 5_000],
                               "allowed_models": [["support-bot", "sql-bot@1.0.0"], []]}
    assert (updated.actor, updated.reason) == ("api-key:abc", "more room")

    api_key_update(api_key=key, controls={"tokens_per_minute": 5_000}, actor="user:olivia")
    assert TenantEvent.objects.filter(kind="key_update").count() == 1  # no change, no event

    api_key_revoke(api_key=key, actor="user:olivia", reason="leaked")
    api_key_revoke(api_key=key, actor="user:olivia")
    revoked = TenantEvent.objects.filter(kind="key_revoke")
    assert [(event.actor, event.reason) for event in revoked] == [("user:olivia", "leaked")]
    with pytest.raises(Conflict, match="is revoked; create a new key instead") as raised:
        api_key_update(api_key=key, controls={"monthly_token_budget": 5}, actor="user:olivia")
    assert raised.value.code == "key_revoked"


def test_the_rest_api_creates_shows_and_changes_a_keys_controls(client_a, tenant_a):
    created = client_a.post("/api/v1/api-keys", {
        "name": "batch job", "scopes": ["inference"], "allowed_models": ["support-bot"], "requests_per_minute": 10,
        "monthly_token_budget": 50_000, "expires_at": "2099-01-01T00:00:00Z", "reason": "nightly batch"},
        format="json")
    assert created.status_code == 201, created.json()
    body = created.json()
    assert (body["allowed_models"], body["requests_per_minute"], body["tokens_per_minute"],
            body["monthly_token_budget"], body["expires_at"]) == (
        ["support-bot"], 10, None, 50_000, "2099-01-01T00:00:00Z")

    changed = client_a.patch(f"/api/v1/api-keys/{body['id']}", {"tokens_per_minute": 4_000, "expires_at": None,
                                                                 "reason": "no expiry after all"}, format="json")
    assert changed.status_code == 200, changed.json()
    assert (changed.json()["tokens_per_minute"], changed.json()["expires_at"],
            changed.json()["requests_per_minute"]) == (4_000, None, 10)
    listed = client_a.get("/api/v1/api-keys").json()["data"]
    assert {row["name"]: row["monthly_token_budget"] for row in listed} == {"batch job": 50_000, "default": None}
    event = TenantEvent.objects.get(kind="key_update")
    assert event.actor.startswith("api-key:") and event.reason == "no expiry after all"

    above = client_a.patch(f"/api/v1/api-keys/{body['id']}", {"requests_per_minute": 5_000}, format="json")
    assert above.status_code == 400
    assert above.json()["error"]["code"] == "key_limit_above_tier"
    assert above.json()["error"]["param"] == "requests_per_minute"
    assert client_a.delete(f"/api/v1/api-keys/{body['id']}?reason=rotated").status_code == 204
    assert TenantEvent.objects.get(kind="key_revoke").reason == "rotated"


def test_another_tenants_key_cannot_be_changed(client_b, tenant_a):
    key = ApiKey.objects.get(tenant=tenant_a.tenant)
    answer = client_b.patch(f"/api/v1/api-keys/{key.pk}", {"requests_per_minute": 1}, format="json")
    assert answer.status_code == 404
    key.refresh_from_db()
    assert key.requests_per_minute is None


def test_an_expired_key_gets_401_key_expired_on_the_management_api(tenant_a):
    key, full_key = api_key_create(tenant=tenant_a.tenant, name="short-lived",
                                   controls={"expires_at": timezone.now() + timedelta(hours=1)})
    client = APIClient()
    assert client.get("/api/v1/tenant", HTTP_AUTHORIZATION=f"Bearer {full_key}").status_code == 200
    ApiKey.objects.filter(pk=key.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    answer = client.get("/api/v1/tenant", HTTP_AUTHORIZATION=f"Bearer {full_key}")
    assert answer.status_code == 401
    error = answer.json()["error"]
    assert error["code"] == "key_expired" and error["type"] == "authentication_error"
    assert f"(lp-{key.prefix}…) expired at" in error["message"]
