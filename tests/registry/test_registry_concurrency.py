"""Two transactions racing on one adapter leave one valid state (PostgreSQL: real row locks).

Each race starts two threads (each with its own database connection) at a barrier (tests.races).
A pre_save hook (tests.races.slow_saves) sleeps inside the transaction to widen the window in
which, without the adapter row lock, both would read the same state and both write; with the lock
the second waits and then sees the first's result. The outcome must be one of the states the two
serial orders produce, with one audit event per successful operation and nothing else raised.
"""

from __future__ import annotations

import pytest

from serving.contracts.errors import Conflict
from serving.registry import services
from serving.registry.models import Adapter, AdapterVersion, DeploymentEvent
from tests.races import race, slow_saves

pytestmark = [
    # The flush after each test wipes the seeded tiers; the tenant fixtures re-seed them
    # (serialized_rollback would clash with the content types the flush re-creates).
    pytest.mark.django_db(transaction=True),
    pytest.mark.postgresql,  # skipped on SQLite, and the run's summary says so (tests/conftest.py)
]

ACTOR = "api-key:race"
ROUNDS = 3


@pytest.fixture
def widened_window():
    with slow_saves(AdapterVersion):
        yield


def served_state(adapter: Adapter) -> dict[str, str | tuple[str, float]]:
    versions = AdapterVersion.objects.filter(adapter_id=adapter.pk)
    assert versions.filter(status="active").count() <= 1
    assert versions.filter(status="canary").count() <= 1
    assert not versions.exclude(status="canary").exclude(traffic_weight=None).exists()
    if versions.filter(status="canary").exists():
        assert versions.filter(status="active").exists(), "a canary without an active version"
    return {item.version: item.status for item in versions.filter(status__in=("active", "canary"))}


def _setup(tenant, name: str, make_version, *, active_chain: list[str], canary: str | None = None,
           ready: list[str] = ()) -> Adapter:
    adapter = services.adapter_create(tenant=tenant, name=name)
    for text in [*active_chain, *([canary] if canary else []), *ready]:
        make_version(adapter, text)
    for text in active_chain:
        services.adapter_version_deploy(version=adapter.versions.get(version=text), actor=ACTOR)
    if canary:
        services.adapter_canary_start(version=adapter.versions.get(version=canary), weight=0.5, actor=ACTOR)
    return adapter


def _check(adapter: Adapter, results: list[object], events_before: int, allowed: list[dict]) -> None:
    unexpected = [result for result in results if isinstance(result, Exception) and not isinstance(result, Conflict)]
    assert not unexpected, unexpected
    successes = sum(not isinstance(result, Exception) for result in results)
    assert DeploymentEvent.objects.filter(adapter_id=adapter.pk).count() == events_before + successes
    assert served_state(adapter) in allowed


def test_promote_races_rollback(tenant_a, make_version, widened_window):
    for round_ in range(ROUNDS):
        adapter = _setup(tenant_a.tenant, f"promote-rollback-{round_}", make_version,
                         active_chain=["1.0.0", "1.1.0"], canary="1.2.0")
        before = DeploymentEvent.objects.filter(adapter_id=adapter.pk).count()
        results = race(lambda: services.adapter_canary_promote(adapter=adapter, actor=ACTOR),
                       lambda: services.adapter_rollback(adapter=adapter, actor=ACTOR))
        assert not isinstance(results[0], Exception), results
        # Promote first, then the rollback returns to 1.1.0; or the rollback is refused (a canary
        # was running) and the promote stands.
        _check(adapter, results, before, [{"1.1.0": "active"}, {"1.2.0": "active"}])


def test_promote_races_abort(tenant_a, make_version, widened_window):
    for round_ in range(ROUNDS):
        adapter = _setup(tenant_a.tenant, f"promote-abort-{round_}", make_version,
                         active_chain=["1.0.0"], canary="1.1.0")
        before = DeploymentEvent.objects.filter(adapter_id=adapter.pk).count()
        results = race(lambda: services.adapter_canary_promote(adapter=adapter, actor=ACTOR),
                       lambda: services.adapter_canary_abort(adapter=adapter, actor=ACTOR))
        assert sum(isinstance(result, Conflict) for result in results) == 1, results
        _check(adapter, results, before, [{"1.1.0": "active"}, {"1.0.0": "active"}])


def test_two_canary_starts_race(tenant_a, make_version, widened_window):
    for round_ in range(ROUNDS):
        adapter = _setup(tenant_a.tenant, f"two-canaries-{round_}", make_version,
                         active_chain=["1.0.0"], ready=["1.1.0", "1.2.0"])
        before = DeploymentEvent.objects.filter(adapter_id=adapter.pk).count()
        versions = [adapter.versions.get(version=text) for text in ("1.1.0", "1.2.0")]
        results = race(*(lambda v=v: services.adapter_canary_start(version=v, weight=0.2, actor=ACTOR)
                         for v in versions))
        assert sum(isinstance(result, Conflict) for result in results) == 1, results
        _check(adapter, results, before, [{"1.0.0": "active", "1.1.0": "canary"},
                                          {"1.0.0": "active", "1.2.0": "canary"}])


def test_deploy_races_rollback(tenant_a, make_version, widened_window):
    for round_ in range(ROUNDS):
        adapter = _setup(tenant_a.tenant, f"deploy-rollback-{round_}", make_version,
                         active_chain=["1.0.0", "1.1.0"], ready=["1.2.0"])
        before = DeploymentEvent.objects.filter(adapter_id=adapter.pk).count()
        target = adapter.versions.get(version="1.2.0")
        results = race(lambda: services.adapter_version_deploy(version=target, actor=ACTOR),
                       lambda: services.adapter_rollback(adapter=adapter, actor=ACTOR))
        assert not any(isinstance(result, Exception) for result in results), results
        # Deploy then rollback → back to 1.1.0; rollback then deploy → 1.2.0.
        _check(adapter, results, before, [{"1.1.0": "active"}, {"1.2.0": "active"}])
