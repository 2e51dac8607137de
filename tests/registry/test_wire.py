"""The registry ↔ worker wire (serving.contracts.registry): typed entries survive JSON both ways, malformed ones are
refused by name, and what the registry really sends parses on the worker's side."""

from __future__ import annotations

import json

import pytest

from serving.registry import selectors, services
from serving.registry.events import event_payload
from serving.registry.models import DeploymentEvent
from serving.contracts.registry import WORKER_KEY_PREFIX, WORKERS_KEY, DeployEvent, RegistrySnapshot, ServedEntry, worker_key

ENTRY = ServedEntry(name="alice-co/support-bot@1.1.0", tenant="alice-co", adapter="support-bot", version="1.1.0",
                    status="canary", weight=0.2, artifact_uri="s3://bucket/adapters/alice-co/support-bot/1.1.0/",
                    manifest_sha256="ab" * 32, base_model="tiny-llama", rank=8)


def test_entries_round_trip_through_json():
    snapshot = RegistrySnapshot(revision=7, base_model="tiny-llama", adapters=[ENTRY])
    assert RegistrySnapshot.from_dict(json.loads(json.dumps(snapshot.to_dict()))) == snapshot
    event = DeployEvent(id=7, type="canary_start", at="2026-12-01T11:00:00+00:00", tenant="alice-co",
                        adapter="support-bot", from_version="1.0.0", to_version="1.1.0", from_weight=None,
                        to_weight=0.2, actor="api-key:x", reason="", served=[ENTRY], dropped=[])
    assert DeployEvent.from_dict(json.loads(json.dumps(event.to_dict()))) == event
    assert event.name_prefix == "alice-co/support-bot@" and ENTRY.name.startswith(event.name_prefix)
    assert worker_key("w1") == WORKER_KEY_PREFIX + "w1" and WORKERS_KEY != WORKER_KEY_PREFIX


@pytest.mark.parametrize(("change", "message"), [
    ({"manifest_sha256": None}, "'manifest_sha256' has the wrong type"),
    ({"rank": "8"}, "'rank' has the wrong type"),
    ({"rank": True}, "'rank' has the wrong type"),
    ({"weight": "0.2"}, "'weight' has the wrong type"),
])
def test_malformed_entries_are_refused_by_field(change, message):
    with pytest.raises(ValueError, match=message):
        ServedEntry.from_dict({**ENTRY.to_dict(), **change})


def test_missing_fields_and_non_objects_are_refused():
    data = ENTRY.to_dict()
    del data["artifact_uri"]
    with pytest.raises(ValueError, match="without 'artifact_uri'"):
        ServedEntry.from_dict(data)
    with pytest.raises(ValueError, match="must be a JSON object"):
        RegistrySnapshot.from_dict([])


@pytest.mark.django_db
def test_what_the_registry_sends_parses_back_unchanged(adapter_a, make_version):
    v1, v2 = make_version(adapter_a, "1.0.0"), make_version(adapter_a, "1.1.0")
    services.adapter_version_deploy(version=v1, actor="api-key:x")
    services.adapter_canary_start(version=v2, weight=0.25, actor="api-key:x")
    snapshot = json.loads(json.dumps(selectors.registry_snapshot()))
    parsed = RegistrySnapshot.from_dict(snapshot)
    assert parsed.to_dict() == snapshot
    assert {entry.name: entry.weight for entry in parsed.adapters} == {
        "alice-co/support-bot@1.0.0": 0.75, "alice-co/support-bot@1.1.0": 0.25}
    event = DeploymentEvent.objects.filter(adapter=adapter_a).first()
    payload = json.loads(json.dumps(event_payload(
        event=event, served=selectors.adapter_served_entries(adapter=adapter_a), dropped=[])))
    assert DeployEvent.from_dict(payload).to_dict() == payload
    assert [entry.name for entry in DeployEvent.from_dict(payload).served] == [e.name for e in parsed.adapters]
