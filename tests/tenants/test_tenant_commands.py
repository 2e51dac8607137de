"""The operator's `manage.py tenants` command and the services behind it."""

from __future__ import annotations

import io

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from rest_framework.test import APIClient

from serving.contracts.errors import Conflict, InvalidInput, NotFound
from tenants.models import ApiKey, Membership, Tenant, Tier
from tenants.services import tenant_activate, tenant_create

pytestmark = pytest.mark.django_db


def run(*args: str) -> str:
    out = io.StringIO()
    call_command("tenants", *args, stdout=out)
    return out.getvalue()


def status_with(key: str) -> int:
    return APIClient().get("/api/v1/tenant", HTTP_AUTHORIZATION=f"Bearer {key}").status_code


def test_the_seeded_tiers_carry_the_design_figures() -> None:
    tiers = {t.name: (t.requests_per_minute, t.max_tokens_per_request, t.priority) for t in Tier.objects.all()}
    assert tiers == {"vip": (1000, 512, 0), "standard": (200, 256, 1), "batch": (50, 1024, 2)}


def test_create_prints_a_working_key_once_and_makes_the_owner() -> None:
    output = run("create", "acme", "--tier", "vip", "--name", "Acme Inc.", "--owner-email", "ops@acme.test")

    key = output.strip().splitlines()[-1]
    assert key.startswith("lp-") and output.count(key) == 1
    tenant = Tenant.objects.get(slug="acme")
    assert (tenant.name, tenant.tier.name, tenant.status) == ("Acme Inc.", "vip", "active")
    assert Membership.objects.get(tenant=tenant).user.email == "ops@acme.test"
    assert Membership.objects.get(tenant=tenant).role == "owner"
    assert status_with(key) == 200
    assert key not in run("list")


def test_duplicate_slug_is_refused_by_the_command_and_the_service() -> None:
    run("create", "acme", "--tier", "standard")
    with pytest.raises(CommandError, match="'acme' already exists"):
        run("create", "acme", "--tier", "batch")
    with pytest.raises(Conflict) as raised:
        tenant_create(slug="acme", tier_name="standard")
    assert raised.value.status_code == 409
    assert Tenant.objects.get().tier.name == "standard" and ApiKey.objects.count() == 1


def test_unknown_tier_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(CommandError, match="Unknown tier 'gold'. Known tiers: vip, standard, batch"):
        run("create", "acme", "--tier", "gold")
    assert not Tenant.objects.exists()


@pytest.mark.parametrize("slug", ["Acme", "acme co", "acme_co", "", "a" * 64, "../etc"])
def test_invalid_slugs_are_refused(slug: str) -> None:
    with pytest.raises(InvalidInput, match="slug"):
        tenant_create(slug=slug, tier_name="standard")
    assert not Tenant.objects.exists()


def test_invalid_owner_email_is_refused_and_nothing_is_created() -> None:
    with pytest.raises(CommandError, match="not an email address"):
        run("create", "acme", "--tier", "standard", "--owner-email", "not-an-email")
    assert not Tenant.objects.exists()


def test_list_shows_tenants_with_tier_status_and_active_keys() -> None:
    assert "No tenants yet" in run("list")
    run("create", "acme", "--tier", "standard")
    run("create", "zeta", "--tier", "batch")
    run("suspend", "zeta")

    lines = run("list").splitlines()
    assert lines[0].split() == ["SLUG", "TIER", "STATUS", "KEYS", "NAME"]
    assert [line.split() for line in lines[1:]] == [
        ["acme", "standard", "active", "1", "acme"], ["zeta", "batch", "suspended", "1", "zeta"]]


def test_suspend_then_activate() -> None:
    key = run("create", "acme", "--tier", "standard").strip().splitlines()[-1]
    assert "Suspended tenant 'acme'" in run("suspend", "acme")
    assert status_with(key) == 403
    assert "Activated tenant 'acme'" in run("activate", "acme")
    assert status_with(key) == 200


def test_suspending_an_unknown_tenant_says_so() -> None:
    with pytest.raises(CommandError, match="No tenant with slug 'nope'"):
        run("suspend", "nope")
    with pytest.raises(NotFound):
        tenant_activate(slug="nope")


def test_create_key_prints_a_working_key_with_the_asked_scopes() -> None:
    run("create", "acme", "--tier", "standard")
    key = run("create-key", "acme", "--name", "gateway", "--scope", "inference").strip().splitlines()[-1]
    assert ApiKey.objects.get(name="gateway").scopes == ["inference"]
    assert status_with(key) == 403  # inference-only: not for the management API
    with pytest.raises(CommandError, match="No tenant with slug 'nope'"):
        run("create-key", "nope", "--name", "x")
