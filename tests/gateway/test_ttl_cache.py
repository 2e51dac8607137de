"""The gateway's key and model caches stay bounded whatever callers send: by entry count, by bytes,
and expired entries are freed as soon as anything is put (not only once the cache is full)."""

from __future__ import annotations

import asyncio

import pytest
from resilience_support import Clock

from serving.gateway.errors import model_not_found
from serving.gateway.ttl_cache import ENTRY_OVERHEAD_BYTES, TtlCache, approx_bytes


def cache(clock: Clock, *, ttl: float = 0.5, entries: int = 1000, max_bytes: int = 10**9) -> TtlCache[str]:
    return TtlCache(lambda: ttl, max_entries=entries, max_bytes=max_bytes, clock=clock)


def test_distinct_keys_beyond_the_entry_bound_evict_the_oldest():
    clock = Clock()
    names = cache(clock, entries=100)
    for index in range(5000):
        names.put(f"model-{index}", "value")
    assert len(names) == 100
    assert names.get("model-4999") == (True, "value")
    assert names.get("model-0") == (False, None)


def test_large_refusals_are_bounded_by_bytes():
    clock = Clock()
    names = cache(clock, max_bytes=1_000_000)
    big = "m" * 100_000
    for index in range(350):
        # What a 404 for a long name caches: the name in the key and again in the message.
        name = f"{index}{big}"
        names.put((1, "prefix", name), model_not_found(name))
    assert names.bytes <= 1_000_000
    assert len(names) == 1_000_000 // approx_bytes((1, "prefix", "0" + big), model_not_found("0" + big))
    # One entry larger than the whole bound is not kept at all.
    names.put("huge", model_not_found("x" * 2_000_000))
    assert names.get("huge") == (False, None) and names.bytes <= 1_000_000


def test_expired_entries_are_freed_by_the_next_put_long_before_the_cache_is_full():
    clock = Clock()
    names = cache(clock, entries=100_000)
    for index in range(500):
        names.put(f"model-{index}", "value")
    assert len(names) == 500
    clock.advance(0.6)
    names.put("fresh", "value")
    assert len(names) == 1 and names.bytes == approx_bytes("fresh", "value") == ENTRY_OVERHEAD_BYTES + 5


def test_an_expired_entry_found_by_get_is_freed():
    clock = Clock()
    names = cache(clock)
    names.put("a", "value")
    clock.advance(0.6)
    assert names.get("a") == (False, None)
    assert len(names) == 0 and names.bytes == 0


def test_put_again_refreshes_the_entry_and_counts_its_bytes_once():
    clock = Clock()
    names = cache(clock)
    names.put("a", "one")
    clock.advance(0.4)
    names.put("b", "value")
    clock.advance(0.2)
    names.put("a", "two")  # a moves behind b: b expires first now
    clock.advance(0.4)  # b's TTL is over, the second a's is not
    names.put("c", "value")
    assert names.get("a") == (True, "two") and names.get("b") == (False, None)
    assert names.bytes == approx_bytes("a", "two") + approx_bytes("c", "value")


@pytest.mark.django_db(transaction=True)
def test_the_catalog_frees_expired_model_lookups(settings, tenant_a, monkeypatch):
    """Through the catalog itself, on the test database: tens of unknown names cached, then gone
    with the next lookup once their TTL is over. (The count is far under the cache's bounds either
    way, so what frees them is their TTL; each lookup is a database query, so more cost CPU only.)"""
    from serving.gateway import catalog

    settings.GATEWAY = settings.GATEWAY.model_copy(update={"cache_s": 0.05})
    catalog.caches_clear()
    # The lookups' cache reads a clock the test moves: under load the lookups outlast a real 0.05 s.
    clock = [1000.0]
    monkeypatch.setattr(catalog._targets, "_clock", lambda: clock[0])

    async def lookups(names: list[str]) -> None:
        caller = await catalog.caller_for(f"Bearer {tenant_a.key}")
        for name in names:
            with pytest.raises(catalog.GatewayError):
                await catalog.target_for(caller, name)

    asyncio.run(lookups([f"unknown-{index}-" + "x" * 200 for index in range(40)]))
    assert len(catalog._targets) == 40
    assert catalog._targets.bytes <= catalog.CACHE_MAX_BYTES and len(catalog._targets) <= catalog.CACHE_MAX_ENTRIES
    clock[0] += 0.1  # past the TTL
    asyncio.run(lookups(["one-more"]))
    assert len(catalog._targets) == 1
    catalog.caches_clear()


@pytest.mark.django_db(transaction=True)
def test_a_cached_refusal_is_raised_as_a_copy_and_keeps_no_request_frames(tenant_a):
    """Raising the cached object itself would chain every hit's frames (bodies included) onto it."""
    from serving.gateway import catalog

    catalog.caches_clear()

    async def twice() -> list[BaseException]:
        caller = await catalog.caller_for(f"Bearer {tenant_a.key}")
        raised = []
        for _ in range(2):
            try:
                await catalog.target_for(caller, "no-such-model")
            except catalog.GatewayError as error:
                raised.append(error)
        return raised

    first, second = asyncio.run(twice())
    assert first is not second and first.status == second.status == 404 and str(first) == str(second)
    caller_key = next(iter(catalog._targets._entries))
    hit, cached = catalog._targets.get(caller_key)
    assert hit and isinstance(cached, catalog.GatewayError)
    assert cached is not first and cached is not second and cached.__traceback__ is None
    catalog.caches_clear()
