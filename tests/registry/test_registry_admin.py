"""Registry admin: lists with filters, and actions that confirm first, call the services, and audit
the admin user."""

from __future__ import annotations

import pytest

from serving.registry import services
from serving.registry.models import Adapter, AdapterVersion, DeploymentEvent

pytestmark = pytest.mark.django_db

ADAPTERS = "/admin/serving/adapter/"
VERSIONS = "/admin/serving/adapterversion/"
EVENTS = "/admin/serving/deploymentevent/"
ACTOR = "api-key:setup"


@pytest.fixture
def canary_running(adapter_a, make_version):
    """support-bot: 1.0.0 deprecated, 1.1.0 active, 1.2.0 canary at 10 %."""
    for text in ("1.0.0", "1.1.0", "1.2.0"):
        make_version(adapter_a, text)
    services.adapter_version_deploy(version=adapter_a.versions.get(version="1.0.0"), actor=ACTOR)
    services.adapter_version_deploy(version=adapter_a.versions.get(version="1.1.0"), actor=ACTOR)
    services.adapter_canary_start(version=adapter_a.versions.get(version="1.2.0"), weight=0.1, actor=ACTOR)
    return adapter_a


def statuses(adapter: Adapter) -> dict[str, tuple[str, float | None]]:
    return {item.version: (item.status, item.traffic_weight) for item in adapter.versions.all()}


def act(client, url: str, action: str, objects, *, confirm: bool = True, **fields: str):
    """Posts the action: the confirmation page, or (confirm) the confirmed form with its fields."""
    data = {"action": action, "_selected_action": [obj.pk for obj in objects], **fields}
    if confirm:
        data["confirm"] = "yes"
    return client.post(url, data)


def last_event(adapter: Adapter) -> DeploymentEvent:
    return DeploymentEvent.objects.filter(adapter=adapter).first()


def test_lists_and_filters(admin_client, canary_running, tenant_b):
    page = admin_client.get(ADAPTERS)
    assert page.status_code == 200
    assert "1.2.0 (10%)" in page.content.decode()
    tenant = canary_running.tenant
    assert admin_client.get(f"{ADAPTERS}?tenant__id__exact={tenant.pk}").status_code == 200
    assert "alice-co/support-bot" in admin_client.get(f"{ADAPTERS}?versions__status=canary").content.decode()
    filtered = admin_client.get(f"{VERSIONS}?status__exact=canary&base_model=tiny-llama").content.decode()
    assert "alice-co/support-bot@1.2.0" in filtered and "alice-co/support-bot@1.1.0" not in filtered
    detail = admin_client.get(f"{ADAPTERS}{canary_running.pk}/change/").content.decode()
    assert "1.0.0" in detail and "deprecated" in detail.lower()
    assert "canary_start" in admin_client.get(EVENTS).content.decode()


def test_promote_asks_first_then_promotes_as_the_admin(admin_client, canary_running):
    confirm = act(admin_client, ADAPTERS, "promote_canary", [canary_running], confirm=False)
    assert confirm.status_code == 200
    text = confirm.content.decode()
    assert "Canary 1.2.0 (10%) becomes the active version; 1.1.0 becomes deprecated." in text
    assert statuses(canary_running)["1.2.0"] == ("canary", 0.1), "nothing changes before confirmation"

    done = act(admin_client, ADAPTERS, "promote_canary", [canary_running], reason="canary is healthy")
    assert done.status_code == 302
    assert statuses(canary_running)["1.2.0"] == ("active", None)
    event = last_event(canary_running)
    assert (event.kind, event.actor, event.reason) == ("promote", "admin:admin", "canary is healthy")


def test_set_canary_weight_validates_the_weight(admin_client, canary_running):
    page = act(admin_client, ADAPTERS, "set_canary_weight", [canary_running], confirm=False).content.decode()
    assert 'name="weight"' in page
    invalid = act(admin_client, ADAPTERS, "set_canary_weight", [canary_running], weight="1.5")
    assert invalid.status_code == 200 and "less than or equal to 1" in invalid.content.decode()
    assert statuses(canary_running)["1.2.0"] == ("canary", 0.1)
    act(admin_client, ADAPTERS, "set_canary_weight", [canary_running], weight="0.4")
    assert statuses(canary_running)["1.2.0"] == ("canary", 0.4)
    event = last_event(canary_running)
    assert (event.kind, event.from_weight, event.to_weight, event.actor) == ("canary_weight", 0.1, 0.4, "admin:admin")


def test_abort_then_rollback(admin_client, canary_running):
    act(admin_client, ADAPTERS, "abort_canary", [canary_running], reason="5xx spike")
    assert statuses(canary_running)["1.2.0"] == ("deprecated", None)
    assert "1.1.0 becomes deprecated; 1.0.0 becomes active again." in act(
        admin_client, ADAPTERS, "rollback", [canary_running], confirm=False).content.decode()
    act(admin_client, ADAPTERS, "rollback", [canary_running])
    assert statuses(canary_running)["1.0.0"] == ("active", None)
    assert [(e.kind, e.actor) for e in DeploymentEvent.objects.filter(adapter=canary_running)[:2]] == [
        ("rollback", "admin:admin"), ("abort", "admin:admin")]


def test_refused_action_shows_the_reason_and_changes_nothing(admin_client, canary_running):
    before, events = statuses(canary_running), DeploymentEvent.objects.count()
    response = act(admin_client, ADAPTERS, "rollback", [canary_running], confirm=False)
    assert ("Refused: Version 1.2.0 is running as a canary (10% of traffic); promote or abort it before you roll "
            "back.") in response.content.decode()
    followed = admin_client.post(ADAPTERS, {"action": "rollback", "_selected_action": [canary_running.pk],
                                            "confirm": "yes"}, follow=True)
    assert followed.status_code == 200
    assert "promote or abort it before you roll back" in followed.content.decode()
    assert statuses(canary_running) == before and DeploymentEvent.objects.count() == events


def test_version_actions_deploy_canary_archive(admin_client, adapter_a, make_version):
    v1, v2, v3 = (make_version(adapter_a, text) for text in ("1.0.0", "1.1.0", "1.2.0"))
    act(admin_client, VERSIONS, "deploy", [v1])
    act(admin_client, VERSIONS, "start_canary", [v2], weight="0.25")
    act(admin_client, VERSIONS, "archive", [v3])
    assert statuses(adapter_a) == {"1.0.0": ("active", None), "1.1.0": ("canary", 0.25), "1.2.0": ("archived", None)}
    assert list(DeploymentEvent.objects.filter(actor="admin:admin").values_list("kind", flat=True)) == [
        "archive", "canary_start", "deploy"]


def test_admin_adds_adapters_through_the_service(admin_client, tenant_a):
    tier = tenant_a.tenant.tier
    tier.max_adapters = 1
    tier.save()
    response = admin_client.post(f"{ADAPTERS}add/", {"tenant": tenant_a.tenant.pk, "name": "first",
                                                     "description": "", "versions-TOTAL_FORMS": 0,
                                                     "versions-INITIAL_FORMS": 0})
    assert response.status_code == 302
    assert Adapter.objects.filter(name="first").exists()
    assert not AdapterVersion.objects.exists()


def test_admin_cannot_delete_rows_directly(admin_client, canary_running):
    assert admin_client.get(f"{ADAPTERS}{canary_running.pk}/delete/").status_code == 403
    version = canary_running.versions.get(version="1.0.0")
    assert admin_client.get(f"{VERSIONS}{version.pk}/delete/").status_code == 403
