"""Issue 37, item 8: a member's playground key (its secret handed to the browser) is revoked when
they sign out, by the dashboard's sign-out or the admin's, and audited; another user's is untouched."""

from __future__ import annotations

import pytest
from django.test import Client
from django.urls import reverse
from rest_framework.exceptions import AuthenticationFailed

from tenants.authentication import api_key_authenticate
from tenants.models import ApiKey, TenantEvent

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fast_passwords")]


@pytest.fixture(autouse=True)
def storage(settings, tmp_path):
    settings.STORAGE_URL = f"file://{tmp_path / 'storage'}"
    settings.BASE_MODEL_PATH = tmp_path / "no-model"


def _playground_key(user) -> tuple[Client, str]:
    client = Client()
    client.force_login(user)
    return client, client.post(reverse("dashboard:playground-key")).json()["key"]


@pytest.mark.parametrize("logout", ["dashboard:logout", "admin:logout"])
def test_signing_out_revokes_the_sessions_playground_key(people, tenant_a, logout):
    if logout.startswith("admin:"):  # the admin's sign-out is staff's
        people.member.is_staff = True
        people.member.save()
    client, key = _playground_key(people.member)
    _, owners = _playground_key(people.owner)
    assert api_key_authenticate(f"Bearer {key}").tenant == tenant_a.tenant

    assert client.post(reverse(logout)).status_code in (200, 302)

    with pytest.raises(AuthenticationFailed, match="revoked"):
        api_key_authenticate(f"Bearer {key}")
    revoked = ApiKey.objects.get(tenant=tenant_a.tenant, name="playground: mario")
    event = TenantEvent.objects.get(kind=TenantEvent.Kind.KEY_REVOKE, subject__contains=revoked.prefix)
    assert (event.actor, event.reason) == ("user:mario", "its user signed out of the dashboard")
    assert api_key_authenticate(f"Bearer {owners}").tenant == tenant_a.tenant  # another user's session's key


def test_signing_out_without_a_playground_key_revokes_nothing(people, tenant_a):
    client = Client()
    client.force_login(people.member)
    live = ApiKey.objects.filter(revoked_at__isnull=True).count()
    assert client.post(reverse("dashboard:logout")).status_code == 302
    assert ApiKey.objects.filter(revoked_at__isnull=True).count() == live
