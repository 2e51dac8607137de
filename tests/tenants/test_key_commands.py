"""`manage.py tenants set-tier|create-key|keys|update-key|revoke-key`: each changes what it says,
through the services, and writes its audit event with the operator's name and the reason."""

from __future__ import annotations

import getpass
import io
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone
from rest_framework.test import APIClient

from tenants.models import ApiKey, Tenant, TenantEvent
from tenants.services import api_key_create

pytestmark = pytest.mark.django_db

OPERATOR = f"operator:{getpass.getuser()}"


def run(*args: str) -> str:
    out = io.StringIO()
    call_command("tenants", *args, stdout=out)
    return out.getvalue()


def test_set_tier_moves_the_tenant_and_audits_it(tenant_a):
    output = run("set-tier", "alice-co", "vip", "--reason", "signed the enterprise plan")
    assert "is on the 'vip' tier: 1000 requests and 512,000 tokens per minute" in output
    assert Tenant.objects.get(slug="alice-co").tier.name == "vip"
    event = TenantEvent.objects.get(kind="tier_change")
    assert (event.subject, event.changes, event.actor, event.reason) == (
        "vip", {"tier": ["standard", "vip"]}, OPERATOR, "signed the enterprise plan")
    with pytest.raises(CommandError, match="already on the 'vip' tier"):
        run("set-tier", "alice-co", "vip")
    with pytest.raises(CommandError, match="Unknown tier 'gold'. Known tiers: vip, standard, batch"):
        run("set-tier", "alice-co", "gold")
    with pytest.raises(CommandError, match="No tenant with slug 'nobody'"):
        run("set-tier", "nobody", "vip")


def test_a_move_to_a_lower_tier_names_the_keys_whose_limits_are_now_above_it(tenant_a):
    run("set-tier", "alice-co", "vip")
    tenant_a.tenant.refresh_from_db()
    key, _ = api_key_create(tenant=tenant_a.tenant, name="fast", controls={"requests_per_minute": 900})
    output = run("set-tier", "alice-co", "batch")
    assert f"Key lp-{key.prefix}… (fast) has limits above the new tier's (scopes inference, manage; rpm 900)" in output


def test_create_key_with_limits_then_keys_lists_them(tenant_a):
    output = run("create-key", "alice-co", "--name", "ci", "--scope", "inference", "--expires", "30d",
                 "--model", "support-bot,sql-bot@1.0.0", "--rpm", "20", "--budget", "1_000_000", "--reason", "CI")
    full_key = output.strip().splitlines()[-1]
    key = ApiKey.objects.get(name="ci")
    assert full_key.startswith(f"lp-{key.prefix}.")
    assert key.allowed_models == ["support-bot", "sql-bot@1.0.0"]
    assert (key.requests_per_minute, key.monthly_token_budget) == (20, 1_000_000)
    assert abs(key.expires_at - (timezone.now() + timedelta(days=30))) < timedelta(minutes=1)
    event = TenantEvent.objects.get(kind="key_create", subject__endswith="(ci)")
    assert (event.actor, event.reason) == (OPERATOR, "CI")

    listing = run("keys", "alice-co")
    assert listing.splitlines()[0].split() == ["KEY", "NAME", "STATE", "LIMITS"]
    assert f"lp-{key.prefix}…" in listing and "models support-bot, sql-bot@1.0.0; rpm 20; monthly budget 1,000,000" \
        in listing
    assert full_key not in listing


def test_update_key_changes_only_what_is_given_and_clears_with_none(tenant_a):
    key, _ = api_key_create(tenant=tenant_a.tenant, name="app", controls={"requests_per_minute": 50,
                                                                          "allowed_models": ["bot"]})
    output = run("update-key", f"lp-{key.prefix}…", "--tpm", "8000", "--rpm", "none", "--all-models",
                 "--expires", "2099-06-30", "--reason", "go wide")
    key.refresh_from_db()
    assert (key.requests_per_minute, key.tokens_per_minute, key.allowed_models) == (None, 8_000, [])
    assert key.expires_at.isoformat() == "2099-06-30T00:00:00+00:00"
    assert f"API key lp-{key.prefix}… (app): scopes inference, manage; expires 2099-06-30T00:00+00:00; tpm 8,000" \
        in output
    event = TenantEvent.objects.get(kind="key_update")
    assert set(event.changes) == {"requests_per_minute", "tokens_per_minute", "allowed_models", "expires_at"}
    assert (event.actor, event.reason) == (OPERATOR, "go wide")

    with pytest.raises(CommandError, match="above the 'standard' tier's requests per minute \\(200\\)"):
        run("update-key", key.prefix, "--rpm", "500")
    with pytest.raises(CommandError, match="--rpm 'fast': give a whole number, or 'none'"):
        run("update-key", key.prefix, "--rpm", "fast")
    with pytest.raises(CommandError, match="--expires 'soon': give a date"):
        run("update-key", key.prefix, "--expires", "soon")
    with pytest.raises(CommandError, match="Nothing to change"):
        run("update-key", key.prefix)


def test_revoke_key_refuses_the_key_from_then_on_and_audits_once(tenant_a):
    key = ApiKey.objects.get(tenant=tenant_a.tenant)
    assert APIClient().get("/api/v1/tenant", **tenant_a.auth).status_code == 200
    output = run("revoke-key", tenant_a.key, "--reason", "leaked in a log")  # the full key names it too
    assert f"Revoked API key lp-{key.prefix}… (default) of tenant 'alice-co'" in output
    assert APIClient().get("/api/v1/tenant", **tenant_a.auth).status_code == 401
    again = run("revoke-key", f"lp-{key.prefix}")
    assert "was already revoked" in again
    events = TenantEvent.objects.filter(kind="key_revoke")
    assert [(event.subject, event.actor, event.reason) for event in events] == [
        (f"lp-{key.prefix}… (default)", OPERATOR, "leaked in a log")]
    with pytest.raises(CommandError, match="No API key with the prefix 'ffffffff'"):
        run("revoke-key", "lp-ffffffff")
