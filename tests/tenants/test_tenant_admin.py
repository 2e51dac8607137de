"""The Django admin for tiers, tenants, memberships and API keys."""

from __future__ import annotations

import re

import pytest
from django.test import Client

from tenants.models import ApiKey, Tenant, Tier

pytestmark = pytest.mark.django_db


@pytest.fixture
def admin(admin_user) -> Client:
    client = Client()
    client.force_login(admin_user)
    return client


def test_every_admin_page_renders(admin, tenant_a) -> None:
    key = ApiKey.objects.get(tenant=tenant_a.tenant)
    for url in ["/admin/tenants/tier/", "/admin/tenants/tenant/", "/admin/tenants/membership/",
                "/admin/tenants/apikey/", f"/admin/tenants/tenant/{tenant_a.tenant.pk}/change/",
                f"/admin/tenants/apikey/{key.pk}/change/", "/admin/tenants/tenant/add/"]:
        assert admin.get(url).status_code == 200, url


def test_api_keys_are_read_only_and_never_show_their_hash(admin, tenant_a) -> None:
    key = ApiKey.objects.get(tenant=tenant_a.tenant)
    for url in ["/admin/tenants/apikey/", f"/admin/tenants/apikey/{key.pk}/change/",
                f"/admin/tenants/tenant/{tenant_a.tenant.pk}/change/"]:
        page = admin.get(url).content.decode()
        assert key.secret_hash not in page and 'name="secret_hash"' not in page
    assert admin.get("/admin/tenants/apikey/add/").status_code == 403
    assert admin.post(f"/admin/tenants/apikey/{key.pk}/change/", {"name": "renamed"}).status_code == 403
    assert admin.get(f"/admin/tenants/apikey/{key.pk}/delete/").status_code == 403
    key.refresh_from_db()
    assert key.name == "default"


def test_revoke_action(admin, tenant_a, tenant_b) -> None:
    a_key = ApiKey.objects.get(tenant=tenant_a.tenant)
    response = admin.post("/admin/tenants/apikey/", {"action": "revoke_keys", "_selected_action": [a_key.pk]},
                          follow=True)
    assert "Revoked 1 API key(s)." in response.content.decode()
    assert ApiKey.objects.get(pk=a_key.pk).revoked_at is not None
    assert ApiKey.objects.get(tenant=tenant_b.tenant).revoked_at is None


def test_adding_a_tenant_shows_its_first_key_once(admin) -> None:
    # By name: after a transactional test's flush the tiers are seeded again under new ids.
    response = admin.post("/admin/tenants/tenant/add/", {
        "slug": "acme", "name": "Acme", "tier": Tier.objects.get(name="standard").pk, "status": "active",
        "memberships-TOTAL_FORMS": 0, "memberships-INITIAL_FORMS": 0,
        "api_keys-TOTAL_FORMS": 0, "api_keys-INITIAL_FORMS": 0,
    }, follow=True)
    page = response.content.decode()
    key = re.search(r"shown once: (lp-[\w-]+\.[\w-]+)", page).group(1)
    tenant = Tenant.objects.get(slug="acme")
    assert ApiKey.objects.get(tenant=tenant).prefix == key[3:].split(".")[0]
    assert key not in admin.get("/admin/tenants/tenant/").content.decode()


def test_suspend_action(admin, tenant_a, tenant_b) -> None:
    admin.post("/admin/tenants/tenant/", {"action": "suspend_tenants", "_selected_action": [tenant_a.tenant.pk]})
    assert Tenant.objects.get(pk=tenant_a.tenant.pk).status == "suspended"
    assert Tenant.objects.get(pk=tenant_b.tenant.pk).status == "active"
