"""The catalog keeps the database off the request path without serving anything older than
GATEWAY_CACHE_SECONDS: an entry past half its life answers while it is reloaded in the background,
concurrent misses share one load, and an adapter's name is answered from its tenant's served
versions (one load for all of a tenant's adapters) exactly as the per-name load answers it."""

from __future__ import annotations

import asyncio
import time

import pytest
from resilience_support import Clock

from serving.gateway import catalog
from serving.gateway.ttl_cache import TtlCache
from serving.registry.models import Adapter, AdapterVersion


def test_an_entry_is_due_for_refresh_once_past_half_its_life():
    clock = Clock()
    names: TtlCache[str] = TtlCache(lambda: 1.0, max_entries=10, max_bytes=10**6, clock=clock)
    names.put("a", "one")
    assert not names.refresh_due("a") and not names.refresh_due("missing")
    clock.advance(0.6)
    assert names.refresh_due("a") and not names.refresh_due("a")  # once: the caller reloads it
    assert names.get("a") == (True, "one")  # still answering meanwhile
    names.put("a", "two", loaded_at=clock() - 0.3)  # the reload began 0.3 s ago: it lives 0.7 s more
    assert not names.refresh_due("a")
    clock.advance(0.65)
    assert names.get("a") == (True, "two")
    clock.advance(0.1)
    assert names.get("a") == (False, None)


@pytest.fixture
def short_cache(settings):
    settings.GATEWAY = settings.GATEWAY.model_copy(update={"cache_s": 0.2})
    catalog.caches_clear()
    yield
    catalog.caches_clear()


async def _settled() -> None:
    """Until the catalog's background loads are done."""
    while catalog._loads:
        await asyncio.gather(*catalog._loads.values(), return_exceptions=True)


def test_concurrent_misses_share_one_load_and_a_late_hit_reloads_in_the_background(short_cache, monkeypatch):
    loads: list[str] = []

    def load(header: str) -> str:
        loads.append(header)
        time.sleep(0.02)  # long enough for every request below to find the load under way
        return f"caller-{len(loads)}"

    monkeypatch.setattr(catalog, "_load_caller", load)
    # The cache's clock moves by hand: on the real one a loaded machine's pause between the loads
    # and the late call outlived the 0.2 s TTL, and the late call waited for a load (a fresh-clone run).
    clock = Clock()
    monkeypatch.setattr(catalog, "_callers", TtlCache(catalog._cache_seconds, max_entries=catalog.CACHE_MAX_ENTRIES,
                                                      max_bytes=catalog.CACHE_MAX_BYTES, clock=clock))

    async def scenario() -> tuple[list[str], str, str]:
        first = await asyncio.gather(*(catalog.caller_for("Bearer lp-x.y") for _ in range(20)))
        clock.advance(0.12)  # past half the TTL (0.2 s), within it
        late = await catalog.caller_for("Bearer lp-x.y")  # answered from the cache, not waited for
        await _settled()
        return first, late, await catalog.caller_for("Bearer lp-x.y")

    first, late, after = asyncio.run(scenario())
    assert set(first) == {"caller-1"} and late == "caller-1" and after == "caller-2"
    assert loads == ["Bearer lp-x.y"] * 2


def _version(adapter: Adapter, version: str, status: str, weight: float | None = None) -> AdapterVersion:
    return AdapterVersion.objects.create(
        adapter=adapter, version=version, status=status, traffic_weight=weight, artifact_uri=f"file:///a/{version}/",
        manifest_sha256=version.replace(".", "").ljust(64, "0"), base_model="tiny", rank=8, lora_alpha=16,
        size_bytes=1, source=AdapterVersion.Source.UPLOAD)


@pytest.mark.django_db(transaction=True)
def test_adapter_names_come_from_the_tenants_served_versions_as_the_per_name_load_answers(short_cache, tenant_a,
                                                                                             settings, monkeypatch):
    settings.BASE_MODEL_NAME, settings.BASE_MODEL_ALIASES = "tiny", []
    # The caches' time moves only when the test moves it: on a loaded machine the lookups below can
    # take longer than the 0.2 s TTL, and entries expired half-way made the entry count a race.
    clock = Clock()
    for cache in (catalog._callers, catalog._targets, catalog._tenants):
        monkeypatch.setattr(cache, "_clock", clock)
    plain = Adapter.objects.create(tenant=tenant_a.tenant, name="plain")
    _version(plain, "1.0.0", AdapterVersion.Status.ACTIVE)
    canaried = Adapter.objects.create(tenant=tenant_a.tenant, name="canaried")
    _version(canaried, "1.0.0", AdapterVersion.Status.ACTIVE)
    _version(canaried, "1.1.0", AdapterVersion.Status.CANARY, weight=0.25)
    _version(Adapter.objects.create(tenant=tenant_a.tenant, name="undeployed"), "1.0.0", AdapterVersion.Status.READY)

    async def resolve(names: list[str]) -> list[object]:
        caller = await catalog.caller_for(f"Bearer {tenant_a.key}")
        found: list[object] = []
        for name in names:
            try:
                found.append(await catalog.target_for(caller, name))
            except catalog.GatewayError as error:
                found.append(error.code)
        return found

    names = ["plain", "canaried", "undeployed", "unknown", "plain@1.0.0", "tiny"]
    targets = asyncio.run(resolve(names))
    caller = catalog._load_caller(f"Bearer {tenant_a.key}")
    expected = []
    for name in names:
        try:
            expected.append(catalog._load_target(caller, name))
        except catalog.GatewayError as error:
            expected.append(error.code)
    assert targets == expected
    assert targets[1].served.canary.version == "1.1.0" and targets[1].served.canary_weight == 0.25
    assert targets[2:4] == ["model_not_deployed", "model_not_found"]
    # The two deployed adapters and the base took no entry of their own: one for the tenant.
    assert len(catalog._tenants) == 1
    assert {key[2] for key in catalog._targets._entries} == {"undeployed", "unknown", "plain@1.0.0"}

    # A deployment holds within the TTL.
    AdapterVersion.objects.filter(adapter=plain).update(status=AdapterVersion.Status.DEPRECATED)
    _version(plain, "2.0.0", AdapterVersion.Status.ACTIVE)
    clock.advance(0.25)  # past the TTL
    assert asyncio.run(resolve(["plain"]))[0].served.active.version == "2.0.0"
