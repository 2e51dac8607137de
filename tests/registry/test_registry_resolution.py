"""What a request's `model` resolves to as the registry changes, through the gateway's own
resolution (its catalog, then the pick by weight), and the snapshot workers reconcile from."""

from __future__ import annotations

import random

import pytest

from serving.registry import selectors, services
from serving.registry.models import DeploymentEvent
from serving.gateway.errors import GatewayError
from tests.registry.conftest import ACTOR, resolve, version

pytestmark = pytest.mark.django_db


def test_resolve_picks_by_canary_weight(deployed, tenant_a):
    services.adapter_canary_start(version=version(deployed, "1.1.0"), weight=0.25, actor=ACTOR)
    rng = random.Random(7)
    picks = [resolve(tenant_a, "support-bot", rng=rng) for _ in range(400)]
    share = picks.count("1.1.0") / len(picks)
    assert 0.18 < share < 0.32  # ±3 standard deviations of 400 draws at p = 0.25
    assert set(picks) == {"1.0.0", "1.1.0"}
    services.adapter_canary_set_weight(adapter=deployed, weight=0.0, actor=ACTOR)
    assert {resolve(tenant_a, "support-bot", rng=rng) for _ in range(50)} == {"1.0.0"}


def test_resolve_pinned_missing_and_other_tenants(deployed, tenant_a, tenant_b, adapter_a, make_version):
    assert resolve(tenant_a, "support-bot@1.1.0") == "1.1.0"
    for model in ("support-bot@9.0.0", "support-bot@latest", "no-such-bot"):
        with pytest.raises(GatewayError) as error:
            resolve(tenant_a, model)
        assert error.value.status == 404 and error.value.code == "model_not_found"
    with pytest.raises(GatewayError) as error:
        resolve(tenant_b, "support-bot")
    assert error.value.message == "The model 'support-bot' does not exist or you do not have access to it."
    services.adapter_create(tenant=tenant_a.tenant, name="idle-bot")
    with pytest.raises(GatewayError, match="has no active version") as error:
        resolve(tenant_a, "idle-bot")
    assert error.value.code == "model_not_deployed"


def test_snapshot_lists_active_and_canary_with_weights(deployed, tenant_b, make_version):
    services.adapter_canary_start(version=version(deployed, "1.1.0"), weight=0.2, actor=ACTOR)
    other = services.adapter_create(tenant=tenant_b.tenant, name="summarizer")
    services.adapter_version_deploy(version=make_version(other, "2.0.0"), actor=ACTOR)
    snapshot = selectors.registry_snapshot()
    assert snapshot["revision"] == DeploymentEvent.objects.order_by("-id").first().id
    assert snapshot["base_model"] == "tiny-llama"
    entries = {entry["name"]: entry for entry in snapshot["adapters"]}
    assert set(entries) == {"alice-co/support-bot@1.0.0", "alice-co/support-bot@1.1.0", "bob-co/summarizer@2.0.0"}
    active = entries["alice-co/support-bot@1.0.0"]
    v1 = version(deployed, "1.0.0")
    assert active == {
        "name": "alice-co/support-bot@1.0.0", "tenant": "alice-co", "adapter": "support-bot", "version": "1.0.0",
        "status": "active", "weight": pytest.approx(0.8), "artifact_uri": v1.artifact_uri,
        "manifest_sha256": v1.manifest_sha256, "base_model": "tiny-llama", "rank": 8,
        "base_model_revision": "",  # a base model from a plain directory has no revision
    }
    assert entries["alice-co/support-bot@1.1.0"]["weight"] == 0.2
    assert entries["bob-co/summarizer@2.0.0"]["weight"] == 1.0

    from tenants.services import tenant_suspend

    tenant_suspend(slug="bob-co")
    assert {entry["tenant"] for entry in selectors.registry_snapshot()["adapters"]} == {"alice-co"}
