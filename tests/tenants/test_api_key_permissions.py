"""Issue 23, item 3: one rule for API keys on every surface (owners create and revoke them), keys
record who created them, and removing a member revokes the keys that member created.

Sessions here log in and send the CSRF token the way a browser does, so a 403 is the role rule and
not a missing token; the keys are then tried on the management API and on the gateway (`/v1`).
"""

from __future__ import annotations

import pytest
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse
from rest_framework.test import APIClient

from serving.gateway import catalog
from serving.gateway.errors import GatewayError
from tenants.models import ApiKey, Membership, TenantEvent
from tenants.services import api_key_create, membership_set_role, playground_key_issue

pytestmark = pytest.mark.django_db


def user_in(tenant, name: str, role: str):
    user = get_user_model().objects.create_user(username=name, email=f"{name}@example.com")
    Membership.objects.create(user=user, tenant=tenant, role=role)
    return user


def browser_session(user) -> tuple[APIClient, dict[str, str]]:
    """A logged-in client that enforces CSRF, and the header carrying the token the dashboard set."""
    client = APIClient(enforce_csrf_checks=True)
    client.force_login(user)
    assert client.get(reverse("dashboard:keys")).status_code == 200  # sets the csrftoken cookie
    return client, {"HTTP_X_CSRFTOKEN": client.cookies["csrftoken"].value}


def message_of(response) -> str:
    return response.json()["error"]["message"]


def works_on_api(key: str) -> int:
    return APIClient().get("/api/v1/tenant", HTTP_AUTHORIZATION=f"Bearer {key}").status_code


def works_on_gateway(key: str) -> int:
    catalog.caches_clear()  # the gateway's 0.5 s cache is not what is under test
    return Client().get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {key}").status_code


def test_a_members_session_with_csrf_cannot_create_or_revoke_keys(tenant_a) -> None:
    member_user = user_in(tenant_a.tenant, "mario", Membership.Role.MEMBER)
    member, csrf = browser_session(member_user)
    default_key = ApiKey.objects.get(tenant=tenant_a.tenant)

    created = member.post("/api/v1/api-keys", {"name": "mine", "scopes": ["inference", "manage"]},
                          format="json", **csrf)
    assert created.status_code == 403, created.content
    assert "owner" in message_of(created) and "CSRF" not in message_of(created)
    assert created.json()["error"]["code"] == "permission_denied"  # a role's refusal, not a key's scope
    revoked = member.delete(f"/api/v1/api-keys/{default_key.id}", **csrf)
    assert revoked.status_code == 403 and "owner" in message_of(revoked)
    default_key.refresh_from_db()
    assert default_key.revoked_at is None and ApiKey.objects.count() == 1
    # Like the dashboard's key page, the list (names and prefixes, never secrets) is every member's to read.
    assert member.get("/api/v1/api-keys").status_code == 200

    # The same session as an owner passes the same CSRF check: the 403s above were the role rule.
    membership_set_role(membership=Membership.objects.get(user=member_user), role=Membership.Role.OWNER)
    assert member.post("/api/v1/api-keys", {"name": "mine"}, format="json", **csrf).status_code == 201


def test_keys_record_who_created_them_on_every_surface(tenant_a) -> None:
    owner_user = user_in(tenant_a.tenant, "olivia", Membership.Role.OWNER)
    owner, csrf = browser_session(owner_user)
    by_session = owner.post("/api/v1/api-keys", {"name": "api", "scopes": ["manage"]}, format="json", **csrf)
    assert by_session.status_code == 201 and by_session.json()["created_by"] == "olivia"
    dashboard = Client()
    dashboard.force_login(owner_user)
    assert dashboard.post(reverse("dashboard:key-create"), {"name": "dash", "scopes": ["inference"]}).status_code == 200
    # A key made with a manage key is the same person's doing: it is revoked with them.
    by_key = APIClient().post("/api/v1/api-keys", {"name": "automation"}, format="json",
                              HTTP_AUTHORIZATION=f"Bearer {by_session.json()['key']}")
    assert by_key.status_code == 201 and by_key.json()["created_by"] == "olivia"
    # Keys made by the operator (tenant_create, `manage.py tenants`) have no creator.
    from_cli, _ = api_key_create(tenant=tenant_a.tenant, name="cli")

    creators = dict(ApiKey.objects.values_list("name", "created_by__username"))
    assert creators == {"default": None, "api": "olivia", "dash": "olivia", "automation": "olivia", "cli": None}
    assert APIClient().get("/api/v1/api-keys", HTTP_AUTHORIZATION=f"Bearer {tenant_a.key}").json()["data"][-1] \
        ["created_by"] is None


# The gateway's views reach the database from their own thread: the rows must be committed.
@pytest.mark.django_db(transaction=True)
def test_removing_a_member_revokes_the_keys_they_created_on_api_and_gateway(tenant_a, tenant_b) -> None:
    owner_user = user_in(tenant_a.tenant, "olivia", Membership.Role.OWNER)
    leaver = user_in(tenant_a.tenant, "mario", Membership.Role.OWNER)
    # mario, while an owner, mints a key for himself through the API; the owners then demote him.
    session, csrf = browser_session(leaver)
    his_key = session.post("/api/v1/api-keys", {"name": "mario's"}, format="json", **csrf).json()["key"]
    membership_set_role(membership=Membership.objects.get(user=leaver), role=Membership.Role.MEMBER)
    _, playground_key = playground_key_issue(tenant=tenant_a.tenant, user=leaver)  # created for him
    _, olivias_key = api_key_create(tenant=tenant_a.tenant, name="olivia's", created_by=owner_user)
    # mario is also in bob-co; removing him from alice-co leaves what he made there alone.
    Membership.objects.create(user=leaver, tenant=tenant_b.tenant, role=Membership.Role.OWNER)
    _, his_bob_key = api_key_create(tenant=tenant_b.tenant, name="mario at bob", created_by=leaver)
    for key in (his_key, playground_key):
        assert works_on_gateway(key) == 200
    assert works_on_api(his_key) == 200

    owner = Client()
    owner.force_login(owner_user)
    page = owner.get(reverse("dashboard:members")).content.decode()
    assert "Remove mario from Alice-Co? The API keys mario created here are revoked too." in page
    removed = owner.post(reverse("dashboard:member-remove", args=[Membership.objects.get(
        user=leaver, tenant=tenant_a.tenant).pk]), follow=True)
    assert "Removed mario; the 2 API keys mario created are revoked." in removed.content.decode()

    for key in (his_key, playground_key):
        assert works_on_api(key) == 401 and works_on_gateway(key) == 401
    for key in (olivias_key, tenant_a.key, his_bob_key):
        assert works_on_gateway(key) == 200
    assert not Membership.objects.filter(user=leaver, tenant=tenant_a.tenant).exists()


def test_deleting_a_user_revokes_the_keys_they_created(tenant_a) -> None:
    leaver = user_in(tenant_a.tenant, "mario", Membership.Role.OWNER)
    key_row, key = api_key_create(tenant=tenant_a.tenant, name="mario's", created_by=leaver)
    leaver.delete()
    key_row.refresh_from_db()
    assert key_row.revoked_at is not None and key_row.created_by is None
    assert works_on_api(key) == 401


def gateway_status(key: str) -> int:
    """What the gateway's key check answers (200: accepted), called directly: through the test client
    the gateway's own connection checks close the test's database connection when a test's first
    request is a gateway one."""
    try:
        catalog.key_authenticate(f"Bearer {key}", scope=ApiKey.Scope.INFERENCE)
    except GatewayError as error:
        return error.status
    return 200


def test_deactivating_a_user_revokes_the_keys_they_created_in_every_tenant(tenant_a, tenant_b) -> None:
    owner_user = user_in(tenant_a.tenant, "olivia", Membership.Role.OWNER)
    leaver = user_in(tenant_a.tenant, "mario", Membership.Role.OWNER)
    Membership.objects.create(user=leaver, tenant=tenant_b.tenant, role=Membership.Role.MEMBER)
    _, alice_key = api_key_create(tenant=tenant_a.tenant, name="mario's", created_by=leaver)
    _, bob_key = api_key_create(tenant=tenant_b.tenant, name="mario at bob", created_by=leaver)
    _, olivias_key = api_key_create(tenant=tenant_a.tenant, name="olivia's", created_by=owner_user)
    leaver.last_name = "Rossi"
    leaver.save()  # an active user's other changes revoke nothing
    assert gateway_status(alice_key) == gateway_status(bob_key) == 200

    leaver.is_active = False
    leaver.save()

    for key in (alice_key, bob_key):
        assert works_on_api(key) == 401 and gateway_status(key) == 401
    assert gateway_status(olivias_key) == gateway_status(tenant_a.key) == 200
    events = TenantEvent.objects.filter(kind="key_revoke").order_by("tenant__slug")
    assert [(event.tenant_id, event.actor, event.reason) for event in events] == [
        (tenant_a.tenant.pk, "user-deactivated:mario", "its creator's account was deactivated"),
        (tenant_b.tenant.pk, "user-deactivated:mario", "its creator's account was deactivated"),
    ]
    leaver.save()  # saved again while inactive: nothing more to revoke, nothing audited twice
    leaver.is_active = True
    leaver.save()  # reactivated: the revoked keys stay revoked
    assert TenantEvent.objects.filter(kind="key_revoke").count() == 2
    assert gateway_status(alice_key) == 401
    assert not ApiKey.objects.filter(created_by=leaver, revoked_at__isnull=True).exists()
