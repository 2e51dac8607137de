"""Dashboard views over the gateway's usage records and catalog: the usage page and its CSV, the
active and canary versions side by side, the overview's meters, and the Playground's key and models."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from serving.registry import services as registry
from tenants.models import ApiKey
from usage_records import record

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fast_passwords")]


@pytest.fixture(autouse=True)
def storage(settings, tmp_path):
    settings.STORAGE_URL = f"file://{tmp_path / 'storage'}"
    settings.BASE_MODEL_PATH = tmp_path / "no-model"


def test_the_playground_key_is_inference_only_reused_and_replaced_when_revoked(as_user, people, tenant_a):
    client = as_user(people.member)
    first = client.post(reverse("dashboard:playground-key")).json()["key"]
    assert client.post(reverse("dashboard:playground-key")).json()["key"] == first
    key = ApiKey.objects.get(tenant=tenant_a.tenant, name="playground: mario")
    assert key.scopes == ["inference"]
    key.revoked_at = timezone.now()
    key.save()
    second = client.post(reverse("dashboard:playground-key")).json()["key"]
    assert second != first
    live = ApiKey.objects.filter(tenant=tenant_a.tenant, name="playground: mario", revoked_at__isnull=True)
    assert [item.prefix for item in live] == [second[3:].split(".")[0]]
    # A new session (the secret is not retrievable) gets a new key and the old one is revoked.
    other = Client()
    other.force_login(people.member)
    third = other.post(reverse("dashboard:playground-key")).json()["key"]
    assert third != second and live.count() == 1


def test_the_playground_offers_every_model_the_gateway_serves_to_the_tenant(as_user, people, tenant_a, tenant_b,
                                                                           make_version, settings):
    from serving.gateway import catalog

    settings.BASE_MODEL_ALIASES = ["example-org/tiny-chat"]
    adapter = registry.adapter_create(tenant=tenant_a.tenant, name="support-bot")
    registry.adapter_version_deploy(version=make_version(adapter, "1.0.0"), actor="test")
    registry.adapter_canary_start(version=make_version(adapter, "1.1.0"), weight=0.25, actor="test")
    make_version(adapter, "1.2.0")  # ready: pinned, never deployed
    registry.adapter_version_archive(version=make_version(adapter, "0.9.0"), actor="test")
    undeployed = registry.adapter_create(tenant=tenant_a.tenant, name="not-deployed")
    make_version(undeployed, "1.0.0")
    registry.adapter_create(tenant=tenant_a.tenant, name="empty")
    bobs = registry.adapter_create(tenant=tenant_b.tenant, name="bobs-bot")
    registry.adapter_version_deploy(version=make_version(bobs, "1.0.0"), actor="test")

    page = as_user(people.member).get(reverse("dashboard:playground"))
    groups = {group["kind"]: [choice["value"] for choice in group["choices"]] for group in page.context["groups"]}
    assert groups == {
        "base": [settings.BASE_MODEL_NAME, "example-org/tiny-chat"],
        "adapter": ["support-bot"],
        "pinned": ["not-deployed@1.0.0", "support-bot@1.2.0", "support-bot@1.1.0", "support-bot@1.0.0"],
    }
    assert b"support-bot (active 1.0.0, canary 1.1.0 at 25%)" in page.content
    assert b"support-bot@1.2.0 (ready, not deployed)" in page.content
    # Each is a name the gateway resolves for the tenant's key (its catalog, as a request would).
    caller = catalog._load_caller(f"Bearer {tenant_a.key}")
    for values in groups.values():
        for value in values:
            catalog._load_target(caller, value)


def test_usage_page_and_csv_show_only_the_tenants_usage(as_user, people, tenant_a, tenant_b):
    mine = ApiKey.objects.filter(tenant=tenant_a.tenant).first()
    record(tenant_a.tenant, adapter="support-bot", version="1.0.0", key=mine.prefix, prompt=7, completion=3)
    record(tenant_a.tenant, key=mine.prefix, prompt=1, completion=1, ago=timedelta(days=2))
    record(tenant_a.tenant, key=mine.prefix, ago=timedelta(days=40))  # outside every period but 90 days
    record(tenant_b.tenant, adapter="bobs-bot", version="1.0.0", prompt=1000)
    client = as_user(people.viewer)
    page = client.get(reverse("dashboard:usage"))
    assert page.context["totals"]["requests"] == 2 and page.context["totals"]["total_tokens"] == 12
    assert [row["adapter"] for row in page.context["by_adapter"]] == [None, "support-bot"]
    assert page.context["by_key"][0]["name"] == "default"
    assert len(page.context["chart"]) == 7 and page.context["chart"][-1]["requests"] == 1
    assert b"bobs-bot" not in page.content
    assert client.get(reverse("dashboard:usage"), {"days": "90"}).context["totals"]["requests"] == 3
    csv_response = client.get(reverse("dashboard:usage-csv"), {"group": "adapter", "days": "30"})
    assert csv_response["Content-Type"] == "text/csv"
    assert "usage-alice-co-by-adapter-30d.csv" in csv_response["Content-Disposition"]
    lines = csv_response.content.decode().splitlines()
    assert lines == ["adapter,requests,prompt_tokens,completion_tokens,total_tokens", ",1,1,1,2",
                     "support-bot,1,7,3,10"]


def test_active_and_canary_side_by_side_from_usage(as_user, people, tenant_a, make_version):
    from serving.registry import selectors

    adapter = registry.adapter_create(tenant=tenant_a.tenant, name="support-bot")
    registry.adapter_version_deploy(version=make_version(adapter, "1.0.0"), actor="test")
    registry.adapter_canary_start(version=make_version(adapter, "1.1.0"), weight=0.1, actor="test")
    for latency in range(10, 101, 10):  # 10 … 100 ms
        record(tenant_a.tenant, adapter="support-bot", version="1.0.0", latency=latency)
    record(tenant_a.tenant, adapter="support-bot", version="1.1.0", latency=300, status="upstream_error")
    record(tenant_a.tenant, adapter="support-bot", version="1.1.0", latency=200)
    record(tenant_a.tenant, adapter="support-bot", version="1.0.0", latency=999, ago=timedelta(days=2))  # too old
    stats = selectors.usage_by_version(adapter=adapter, versions=["1.0.0", "1.1.0"],
                                       since=timezone.now() - timedelta(hours=24))
    assert stats["1.0.0"] == {"requests": 10, "errors": 0, "error_rate": 0.0, "p50_ms": 50, "p95_ms": 100,
                                   "tokens": 150}
    assert stats["1.1.0"]["error_rate"] == 0.5 and stats["1.1.0"]["p50_ms"] == 200
    page = as_user(people.viewer).get(reverse("dashboard:adapter", args=["support-bot"]))
    assert page.context["active_usage"]["requests"] == 10 and page.context["canary_usage"]["errors"] == 1
    assert b"50%" in page.content  # the canary's error rate


def test_the_overview_meters_count_the_last_minute(as_user, people, tenant_a):
    record(tenant_a.tenant, prompt=100, completion=20, ago=timedelta(seconds=10))
    record(tenant_a.tenant, prompt=1000, completion=0, ago=timedelta(minutes=5))
    partial = as_user(people.viewer).get(reverse("dashboard:overview"), HTTP_HX_REQUEST="true")
    assert partial.context["minute"] == {"requests": 1, "tokens": 120}
    assert b'id="quota"' in partial.content and b"<h1>" not in partial.content
    assert b"every 2s [document.visibilityState === 'visible']" in partial.content
