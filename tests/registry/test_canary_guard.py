"""Automatic canary abort through the registry's own service: one audit event, deploy event out."""

from __future__ import annotations

import json
import threading

import pytest
from django.db import connections

from serving.registry import services
from serving.registry.canary_guard import canary_guard_abort
from serving.contracts.registry import events_channel
from serving.registry.models import Adapter, AdapterVersion, DeploymentEvent

ACTOR = "api-key:test"


def with_canary(adapter: Adapter, make_version) -> Adapter:
    """support-bot with 1.0.0 active and 1.1.0 as a canary at 0.3."""
    services.adapter_version_deploy(version=make_version(adapter, "1.0.0"), actor=ACTOR)
    services.adapter_canary_start(version=make_version(adapter, "1.1.0"), weight=0.3, actor=ACTOR)
    return adapter


def statuses(adapter: Adapter) -> dict[str, str]:
    return dict(AdapterVersion.objects.filter(adapter_id=adapter.pk).values_list("version", "status"))


def guard_events(adapter: Adapter) -> list[DeploymentEvent]:
    return list(DeploymentEvent.objects.filter(adapter_id=adapter.pk, actor="system:canary-guard"))


@pytest.mark.django_db
def test_abort_is_audited_once_and_reaches_the_workers(adapter_a, make_version, redis_client,
                                                       django_capture_on_commit_callbacks):
    adapter = with_canary(adapter_a, make_version)
    pubsub = redis_client.pubsub()
    pubsub.subscribe(events_channel(int(redis_client.connection_pool.connection_kwargs.get("db", 0))))
    pubsub.get_message(timeout=5)
    reason = "canary alice-co/support-bot@1.1.0: circuit breaker opened; 50 of 50 calls failed (100%)"
    with django_capture_on_commit_callbacks(execute=True):
        event = canary_guard_abort(tenant_slug="alice-co", adapter_name="support-bot", version="1.1.0",
                                   reason=reason)
    assert statuses(adapter) == {"1.0.0": "active", "1.1.0": "deprecated"}
    assert (event.kind, event.actor, event.from_version, event.to_version, event.from_weight, event.reason) == (
        "abort", "system:canary-guard", "1.1.0", "1.0.0", 0.3, reason)
    message = pubsub.get_message(ignore_subscribe_messages=True, timeout=5)
    payload = json.loads(message["data"])
    assert (payload["type"], payload["actor"]) == ("abort", "system:canary-guard")
    assert [entry["name"] for entry in payload["dropped"]] == ["alice-co/support-bot@1.1.0"]
    assert [entry["name"] for entry in payload["served"]] == ["alice-co/support-bot@1.0.0"]

    # A second gateway process reaching the same verdict changes nothing.
    assert canary_guard_abort(tenant_slug="alice-co", adapter_name="support-bot", version="1.1.0",
                              reason=reason) is None
    assert len(guard_events(adapter)) == 1


@pytest.mark.django_db
def test_a_verdict_on_an_earlier_canary_leaves_the_new_one_alone(adapter_a, make_version):
    adapter = with_canary(adapter_a, make_version)
    services.adapter_canary_abort(adapter=adapter, actor=ACTOR, reason="by hand")
    services.adapter_canary_start(version=make_version(adapter, "1.2.0"), weight=0.1, actor=ACTOR)
    assert canary_guard_abort(tenant_slug="alice-co", adapter_name="support-bot", version="1.1.0",
                              reason="stale verdict") is None
    assert statuses(adapter)["1.2.0"] == "canary" and guard_events(adapter) == []


@pytest.mark.django_db
def test_other_tenants_and_unknown_adapters_are_untouched(adapter_a, make_version, tenant_b):
    adapter = with_canary(adapter_a, make_version)
    assert canary_guard_abort(tenant_slug="bob-co", adapter_name="support-bot", version="1.1.0",
                              reason="wrong tenant") is None
    assert canary_guard_abort(tenant_slug="alice-co", adapter_name="nope", version="1.1.0", reason="x") is None
    assert statuses(adapter)["1.1.0"] == "canary"


@pytest.mark.django_db(transaction=True)
def test_racing_gateway_processes_abort_once(adapter_a, make_version):
    adapter = with_canary(adapter_a, make_version)
    barrier = threading.Barrier(4)
    results: list[object] = []

    def verdict() -> None:
        try:
            barrier.wait()
            results.append(canary_guard_abort(tenant_slug="alice-co", adapter_name="support-bot",
                                              version="1.1.0", reason="breaker opened"))
        except Exception as error:  # the race's outcome, inspected below
            results.append(error)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=verdict) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sum(isinstance(result, DeploymentEvent) for result in results) == 1
    assert results.count(None) == 3
    assert len(guard_events(adapter)) == 1 and statuses(adapter)["1.1.0"] == "deprecated"
