"""Admin actions that change state need the model's change permission (docs/security.md).

Read-only staff (view permissions only) see the adapters but cannot run promote, rollback or any other
state-changing action: the action is not offered, posting it changes nothing and writes no audit row.
Every action on every registered admin, across the apps, is checked for the permission too.
"""

from __future__ import annotations

import pytest
from django.contrib import admin
from django.contrib.auth.models import Permission, User
from django.test import Client

from serving.registry import services
from serving.registry.models import Adapter, DeploymentEvent
from tenants.models import Tenant

pytestmark = pytest.mark.django_db

ADAPTERS = "/admin/serving/adapter/"
VERSIONS = "/admin/serving/adapterversion/"
TENANTS = "/admin/tenants/tenant/"
ACTOR = "api-key:setup"


def staff_with(*codenames: str) -> Client:
    user = User.objects.create_user(username="-".join(codenames) or "bare", password="x", is_staff=True)
    user.user_permissions.set(Permission.objects.filter(codename__in=codenames))
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def canary_running(adapter_a, make_version) -> Adapter:
    """support-bot: 1.0.0 deprecated, 1.1.0 active, 1.2.0 canary at 10 %."""
    for text in ("1.0.0", "1.1.0", "1.2.0"):
        make_version(adapter_a, text)
    services.adapter_version_deploy(version=adapter_a.versions.get(version="1.0.0"), actor=ACTOR)
    services.adapter_version_deploy(version=adapter_a.versions.get(version="1.1.0"), actor=ACTOR)
    services.adapter_canary_start(version=adapter_a.versions.get(version="1.2.0"), weight=0.1, actor=ACTOR)
    return adapter_a


def statuses(adapter: Adapter) -> dict[str, tuple[str, float | None]]:
    return {item.version: (item.status, item.traffic_weight) for item in adapter.versions.all()}


def confirmed(client: Client, url: str, action: str, pks: list[int], **fields: str):
    return client.post(url, {"action": action, "_selected_action": pks, "confirm": "yes", **fields}, follow=True)


READ_ONLY = ("view_adapter", "view_adapterversion")


@pytest.mark.parametrize("action", ["promote_canary", "rollback", "abort_canary", "set_canary_weight"])
def test_read_only_staff_cannot_run_adapter_actions(canary_running, action) -> None:
    client = staff_with(*READ_ONLY)
    assert client.get(ADAPTERS).status_code == 200, "view permission still shows the list"
    assert f'value="{action}"' not in client.get(ADAPTERS).content.decode(), "the action is not offered"
    before, events = statuses(canary_running), DeploymentEvent.objects.count()

    # The confirmation page (the first step) is refused as well as the confirmed call.
    client.post(ADAPTERS, {"action": action, "_selected_action": [canary_running.pk]})
    assert confirmed(client, ADAPTERS, action, [canary_running.pk], weight="0.5").status_code == 200
    assert statuses(canary_running) == before
    assert DeploymentEvent.objects.count() == events, "no audit row for an action that did not run"


@pytest.mark.parametrize("action", ["deploy", "start_canary", "archive"])
def test_read_only_staff_cannot_run_version_actions(adapter_a, make_version, action) -> None:
    services.adapter_version_deploy(version=make_version(adapter_a, "1.0.0"), actor=ACTOR)
    version, events = make_version(adapter_a, "1.1.0"), DeploymentEvent.objects.count()
    client = staff_with(*READ_ONLY)
    confirmed(client, VERSIONS, action, [version.pk], weight="0.5")
    version.refresh_from_db()
    assert version.status == "ready"
    assert DeploymentEvent.objects.count() == events


def test_staff_with_change_permission_promote_and_roll_back(canary_running) -> None:
    client = staff_with(*READ_ONLY, "change_adapter")
    page = client.get(ADAPTERS).content.decode()
    assert 'value="promote_canary"' in page and 'value="rollback"' in page
    confirmed(client, ADAPTERS, "promote_canary", [canary_running.pk], reason="healthy")
    assert statuses(canary_running)["1.2.0"] == ("active", None)
    confirmed(client, ADAPTERS, "rollback", [canary_running.pk])
    assert statuses(canary_running)["1.1.0"] == ("active", None)
    assert [(e.kind, e.actor) for e in DeploymentEvent.objects.filter(adapter=canary_running)[:2]] == [
        ("rollback", "admin:view_adapter-view_adapterversion-change_adapter"),
        ("promote", "admin:view_adapter-view_adapterversion-change_adapter")]


def test_staff_with_version_change_permission_deploy(adapter_a, make_version) -> None:
    version = make_version(adapter_a, "1.0.0")
    confirmed(staff_with(*READ_ONLY, "change_adapterversion"), VERSIONS, "deploy", [version.pk])
    version.refresh_from_db()
    assert version.status == "active"


def test_read_only_staff_cannot_suspend_tenants(tenant_a) -> None:
    client = staff_with("view_tenant")
    client.post(TENANTS, {"action": "suspend_tenants", "_selected_action": [tenant_a.tenant.pk]})
    assert Tenant.objects.get(pk=tenant_a.tenant.pk).status == "active"
    staff_with("view_tenant", "change_tenant").post(
        TENANTS, {"action": "suspend_tenants", "_selected_action": [tenant_a.tenant.pk]})
    assert Tenant.objects.get(pk=tenant_a.tenant.pk).status == "suspended"


def test_every_admin_action_names_a_permission() -> None:
    """No admin action anywhere runs on view permission alone: each declares the permission it needs
    (Django's own delete_selected declares "delete")."""
    unguarded = []
    for model, model_admin in admin.site._registry.items():
        for name in model_admin.actions or ():
            func = getattr(model_admin, name) if isinstance(name, str) else name
            permissions = getattr(func, "allowed_permissions", ())
            if not permissions or "view" in permissions:
                unguarded.append(f"{model._meta.label}.{getattr(func, '__name__', name)}")
    assert unguarded == []
