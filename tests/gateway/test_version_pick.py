"""Canary choice by weight, sticky per user, and pinned versions through the real gateway."""

from __future__ import annotations

import random

import httpx
import pytest

from serving.gateway.version_pick import ServedSet, ServedVersion, pick_version, user_point


def version(name: str, status: str) -> ServedVersion:
    return ServedVersion(tenant="alice-co", adapter="support-bot", version=name, artifact_uri=f"file:///a/{name}/",
                         manifest_sha256="0" * 64, status=status)


ACTIVE, CANARY = version("1.0.0", "active"), version("1.1.0", "canary")


def test_2000_requests_at_weight_0_3_land_within_3_points_of_30_percent():
    served = ServedSet(active=ACTIVE, canary=CANARY, canary_weight=0.3)
    rng = random.Random(1234)
    picks = [pick_version(served, user=None, rng=rng) for _ in range(2000)]
    assert abs(picks.count(CANARY) / 2000 - 0.3) <= 0.03


def test_users_are_sticky_and_spread_by_the_weight():
    served = ServedSet(active=ACTIVE, canary=CANARY, canary_weight=0.3)
    users = [f"user-{index}" for index in range(2000)]
    first = [pick_version(served, user=user, rng=random.Random(index)) for index, user in enumerate(users)]
    again = [pick_version(served, user=user, rng=random.Random(index + 99)) for index, user in enumerate(users)]
    assert first == again
    assert abs(first.count(CANARY) / 2000 - 0.3) <= 0.03
    # Raising the weight moves users onto the canary only, never off it.
    wider = [pick_version(ServedSet(active=ACTIVE, canary=CANARY, canary_weight=0.6), user=user) for user in users]
    assert all(later is CANARY for before, later in zip(first, wider) if before is CANARY)


def test_the_user_point_is_per_adapter_and_stable():
    assert user_point("u", tenant="t", adapter="a") == user_point("u", tenant="t", adapter="a")
    assert user_point("u", tenant="t", adapter="a") != user_point("u", tenant="t", adapter="b")
    assert 0.0 <= user_point("u", tenant="t", adapter="a") < 1.0


def test_no_canary_or_weight_zero_serves_the_active_version():
    assert pick_version(ServedSet(active=ACTIVE), user=None) is ACTIVE
    assert pick_version(ServedSet(active=ACTIVE, canary=CANARY, canary_weight=0.0), user="u") is ACTIVE
    assert pick_version(ServedSet(active=ACTIVE, canary=CANARY, canary_weight=1.0), user="u") is CANARY


@pytest.mark.django_db(transaction=True)
def test_through_the_gateway_canary_sticky_user_and_pins(web, worker, registry, tenant_a, adapter_dirs,
                                                         redis_client):
    from serving.registry import services
    from tests.gateway.conftest import upload_version, wait_for_worker

    adapter = services.adapter_create(tenant=tenant_a.tenant, name="pinned-bot")
    v1 = upload_version(adapter, adapter_dirs[0], "1.0.0")
    v2 = upload_version(adapter, adapter_dirs[1], "1.1.0")
    v3 = upload_version(adapter, adapter_dirs[2], "1.2.0")
    services.adapter_version_deploy(version=v1, actor="test")
    services.adapter_canary_start(version=v2, weight=0.5, actor="test")
    wait_for_worker(redis_client, "gw-worker-1")
    headers = {"Authorization": f"Bearer {tenant_a.key}"}

    def served(model: str, **extra) -> str:
        reply = httpx.post(f"{web.url}/v1/completions", headers=headers, timeout=120,
                           json={"model": model, "prompt": "hi", "max_tokens": 1, **extra})
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == model
        return reply.headers["x-loraplex-adapter-version"]

    seen = {served("pinned-bot") for _ in range(16)}
    assert seen == {"1.0.0", "1.1.0"}
    assert len({served("pinned-bot", user="alice@example.com") for _ in range(6)}) == 1
    # A pin serves that version whatever its status (1.2.0 is only ready, never deployed).
    assert served("pinned-bot@1.2.0") == "1.2.0"
    assert served("pinned-bot@1.0.0") == "1.0.0"
    services.adapter_version_archive(version=v3, actor="test")
    import time

    time.sleep(1.0)  # the gateway's caches hold 0.5 s
    gone = httpx.post(f"{web.url}/v1/completions", headers=headers, timeout=60,
                      json={"model": "pinned-bot@1.2.0", "prompt": "hi", "max_tokens": 1})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
