"""Prefix caching across tenants through the real web process and serving worker: a tenant's
repeated base-model prompt reuses its cached blocks, and another tenant's identical prompt does not
(the gateway salts each tenant's requests: docs/gateway.md), so no tenant can time another's."""

from __future__ import annotations

import httpx
import pytest

from tenants.services import tenant_create
from tests.gateway.conftest import wait_for_worker

pytestmark = pytest.mark.django_db(transaction=True)

# Long enough for several full KV blocks whatever the tokenizer makes of it.
PROMPT = " ".join(f"Clause {n} of the shared system prompt says the same thing." for n in range(12))


def cached_tokens(web, key: str, model: str) -> int:
    reply = httpx.post(f"{web.url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                       json={"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0})
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def test_a_tenants_prompt_blocks_are_cached_for_it_and_not_for_another_tenant(web, registry, worker, redis_client):
    wait_for_worker(redis_client, "gw-worker-1")
    _, alice = tenant_create(slug="salt-alice", tier_name="standard")
    _, bob = tenant_create(slug="salt-bob", tier_name="standard")
    model = httpx.get(f"{web.url}/v1/models", headers={"Authorization": f"Bearer {alice}"}).json()["data"][0]["id"]
    assert cached_tokens(web, alice, model) == 0
    assert cached_tokens(web, alice, model) > 0, "the tenant's second identical prompt reuses its blocks"
    assert cached_tokens(web, bob, model) == 0, "another tenant's identical prompt must not hit them"
    assert cached_tokens(web, bob, model) > 0
