"""Archiving a whole adapter (`adapter_archive`) and a served version by force: what deleting a
fine-tuned model through /v1 does (serving.gateway.model_delete), through serving.registry.services."""

from __future__ import annotations

import json

import pytest

from serving.registry import selectors, services
from serving.gateway.errors import GatewayError
from serving.registry.models import AdapterVersion, DeploymentEvent
from serving.contracts.errors import Conflict
from serving.contracts.registry import events_channel
from tests.registry.conftest import ACTOR, resolve, version

pytestmark = pytest.mark.django_db

Status = AdapterVersion.Status


def statuses(adapter) -> dict[str, str]:
    return dict(adapter.versions.values_list("version", "status"))


def archive_events(adapter) -> list[tuple[str, str, str]]:
    return list(DeploymentEvent.objects.filter(adapter=adapter, kind=DeploymentEvent.Kind.ARCHIVE).order_by("id")
                .values_list("to_version", "actor", "reason"))


def test_a_served_adapter_is_refused_whole_and_nothing_changes(deployed, make_version):
    make_version(deployed, "1.2.0")
    services.adapter_canary_start(version=version(deployed, "1.2.0"), weight=0.3, actor=ACTOR)
    before = statuses(deployed)
    with pytest.raises(Conflict, match=r"serving 1\.0\.0 \(active\), 1\.2\.0 \(canary\)") as refused:
        services.adapter_archive(adapter=deployed, actor=ACTOR, reason="cleanup")
    assert refused.value.code == "adapter_serving"
    assert statuses(deployed) == before and archive_events(deployed) == []


def test_forced_archive_stops_serving_canary_first_one_event_per_version(deployed, make_version, tenant_a):
    make_version(deployed, "1.2.0")
    services.adapter_canary_start(version=version(deployed, "1.2.0"), weight=0.3, actor=ACTOR)
    archived = services.adapter_archive(adapter=deployed, actor="api-key:abc", reason="retired", force=True)
    assert [item.version for item in archived] == ["1.2.0", "1.0.0", "1.1.0"]
    assert set(statuses(deployed).values()) == {Status.ARCHIVED}
    assert archive_events(deployed) == [("1.2.0", "api-key:abc", "retired"), ("1.0.0", "api-key:abc", "retired"),
                                        ("1.1.0", "api-key:abc", "retired")]
    assert "support-bot" not in json.dumps(selectors.registry_snapshot())
    # Deleted, the name is as unknown as another tenant's: the same 404.
    for model in ("support-bot", "support-bot@1.0.0"):
        with pytest.raises(GatewayError) as refused:
            resolve(tenant_a, model)
        assert refused.value.code == "model_not_found"
    assert services.adapter_archive(adapter=deployed, actor=ACTOR) == []


def test_an_adapter_serving_nothing_is_archived_without_force(adapter_a, make_version):
    make_version(adapter_a, "1.0.0")
    make_version(adapter_a, "1.1.0")
    assert len(services.adapter_archive(adapter=adapter_a, actor=ACTOR)) == 2
    assert set(statuses(adapter_a).values()) == {Status.ARCHIVED}


def test_forcing_the_active_version_waits_for_the_canary(deployed):
    services.adapter_canary_start(version=version(deployed, "1.1.0"), weight=0.3, actor=ACTOR)
    with pytest.raises(Conflict, match="running as a canary") as refused:
        services.adapter_version_archive(version=version(deployed, "1.0.0"), actor=ACTOR, force=True)
    assert refused.value.code == "canary_running"
    services.adapter_version_archive(version=version(deployed, "1.1.0"), actor=ACTOR, force=True)
    services.adapter_version_archive(version=version(deployed, "1.0.0"), actor=ACTOR, force=True)
    assert statuses(deployed) == {"1.0.0": Status.ARCHIVED, "1.1.0": Status.ARCHIVED}
    assert selectors.adapter_served(adapter=deployed) == (None, None)


def test_a_forced_archive_event_drops_the_served_version(deployed, redis_client, django_capture_on_commit_callbacks):
    with pytest.raises(Conflict, match="is active") as refused:
        services.adapter_version_archive(version=version(deployed, "1.0.0"), actor=ACTOR)
    assert refused.value.code == "version_serving"
    pubsub = redis_client.pubsub()
    pubsub.subscribe(events_channel(int(redis_client.connection_pool.connection_kwargs.get("db", 0))))
    pubsub.get_message(timeout=5)
    with django_capture_on_commit_callbacks(execute=True):
        services.adapter_version_archive(version=version(deployed, "1.0.0"), actor=ACTOR, force=True)
    message = pubsub.get_message(ignore_subscribe_messages=True, timeout=5)
    pubsub.close()
    assert message is not None, "no deploy event arrived"
    event = json.loads(message["data"])
    assert (event["type"], event["served"]) == ("archive", [])
    assert [entry["name"] for entry in event["dropped"]] == ["alice-co/support-bot@1.0.0"]
