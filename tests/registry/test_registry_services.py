"""Registry operations and invariants, through serving.registry.services (the one place that changes state)."""

from __future__ import annotations

import json

import pytest
from django.db import IntegrityError, connection, transaction

from serving.contracts.errors import Conflict, InvalidInput, LimitExceeded, NotFound
from serving.registry import selectors, services
from serving.gateway.errors import GatewayError
from serving.contracts.registry import events_channel
from serving.registry.models import Adapter, AdapterVersion, DeploymentEvent
from serving.registry.versions import version_next_patch, version_parse
from tests.registry.conftest import ACTOR, resolve, version

pytestmark = pytest.mark.django_db

Status = AdapterVersion.Status


def state(adapter: Adapter) -> dict[str, tuple[str, float | None]]:
    return {item.version: (item.status, item.traffic_weight) for item in adapter.versions.all()}


def kinds(adapter: Adapter) -> list[str]:
    return list(DeploymentEvent.objects.filter(adapter=adapter).order_by("id").values_list("kind", flat=True))


# --- adapters ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["", "Support", "-bot", "bot-", "a" * 64, "bot/x", "bot@1", "tiny-llama"])
def test_adapter_create_refuses_bad_names(tenant_a, name):
    with pytest.raises(InvalidInput) as error:
        services.adapter_create(tenant=tenant_a.tenant, name=name)
    assert error.value.param == "name"
    assert not Adapter.objects.exists()


def test_adapter_create_refuses_duplicates_per_tenant_only(tenant_a, tenant_b, adapter_a):
    with pytest.raises(Conflict, match="already exists"):
        services.adapter_create(tenant=tenant_a.tenant, name="support-bot")
    other = services.adapter_create(tenant=tenant_b.tenant, name="support-bot")
    assert other.tenant == tenant_b.tenant


def test_adapter_create_enforces_tier_max_adapters(tenant_a):
    tier = tenant_a.tenant.tier
    tier.max_adapters = 2
    tier.save()
    services.adapter_create(tenant=tenant_a.tenant, name="one")
    services.adapter_create(tenant=tenant_a.tenant, name="two")
    with pytest.raises(LimitExceeded, match=r"has 2 adapters, the most its tier 'standard' allows \(2\)"):
        services.adapter_create(tenant=tenant_a.tenant, name="three")
    assert Adapter.objects.filter(tenant=tenant_a.tenant).count() == 2


# --- versions ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["1.0", "v1.0.0", "01.0.0", "1.0.0+build.5", "1.0.0-", "latest", ""])
def test_version_parse_refuses_non_semver(text):
    with pytest.raises(InvalidInput) as error:
        version_parse(text)
    assert error.value.param == "version"


def test_version_order_and_next_patch():
    ordered = ["1.0.0-alpha", "1.0.0-alpha.1", "1.0.0-beta", "1.0.0-beta.2", "1.0.0-beta.11", "1.0.0", "1.2.0",
               "1.10.0"]
    assert sorted(reversed(ordered), key=version_parse) == ordered
    assert version_next_patch([]) == "1.0.0"
    assert version_next_patch(["1.0.0", "1.10.0", "1.2.3"]) == "1.10.1"
    assert version_next_patch(["1.0.0", "1.1.0-rc.2"]) == "1.1.0"


def test_adapter_version_next_for_training(tenant_a, tenant_b, adapter_a, make_version):
    assert selectors.adapter_version_next(tenant=tenant_a.tenant, adapter_name="support-bot") == "1.0.0"
    make_version(adapter_a, "1.0.0")
    make_version(adapter_a, "1.0.7")
    assert selectors.adapter_version_next(tenant=tenant_a.tenant, adapter_name="support-bot") == "1.0.8"
    assert selectors.adapter_version_next(tenant=tenant_b.tenant, adapter_name="support-bot") == "1.0.0"


# --- deploy -----------------------------------------------------------------------------------


def test_deploy_makes_active_and_deprecates_the_old_active(deployed):
    services.adapter_version_deploy(version=version(deployed, "1.1.0"), actor=ACTOR, reason="better evals")
    assert state(deployed) == {"1.0.0": ("deprecated", None), "1.1.0": ("active", None)}
    event = DeploymentEvent.objects.filter(adapter=deployed).first()
    assert (event.kind, event.from_version, event.to_version, event.actor, event.reason) == (
        "deploy", "1.0.0", "1.1.0", ACTOR, "better evals")
    assert kinds(deployed) == ["deploy", "deploy"]


def test_deploy_refusals_change_nothing(deployed, make_version, settings):
    make_version(deployed, "0.9.0", status=Status.ARCHIVED)
    make_version(deployed, "2.0.0", base_model="other-base")
    before, events = state(deployed), kinds(deployed)
    with pytest.raises(Conflict, match="already the active version"):
        services.adapter_version_deploy(version=version(deployed, "1.0.0"), actor=ACTOR)
    with pytest.raises(Conflict, match="archived versions are never served"):
        services.adapter_version_deploy(version=version(deployed, "0.9.0"), actor=ACTOR)
    with pytest.raises(Conflict, match="built for base model 'other-base'"):
        services.adapter_version_deploy(version=version(deployed, "2.0.0"), actor=ACTOR)
    assert state(deployed) == before and kinds(deployed) == events


def test_deploy_refused_while_a_canary_runs(deployed, make_version):
    make_version(deployed, "1.2.0")
    services.adapter_canary_start(version=version(deployed, "1.1.0"), weight=0.1, actor=ACTOR)
    with pytest.raises(Conflict, match="promote or abort it"):
        services.adapter_version_deploy(version=version(deployed, "1.2.0"), actor=ACTOR)
    with pytest.raises(Conflict, match="running canary; promote it instead"):
        services.adapter_version_deploy(version=version(deployed, "1.1.0"), actor=ACTOR)
    assert version(deployed, "1.2.0").status == Status.READY


# --- canary -----------------------------------------------------------------------------------


def test_canary_needs_an_active_version(adapter_a, make_version):
    ready = make_version(adapter_a, "1.0.0")
    with pytest.raises(Conflict, match="has no active version"):
        services.adapter_canary_start(version=ready, weight=0.1, actor=ACTOR)
    assert state(adapter_a) == {"1.0.0": ("ready", None)} and kinds(adapter_a) == []


@pytest.mark.parametrize("weight", [-0.1, 1.5, float("nan"), float("inf"), True, "0.5", None])
def test_canary_weight_must_be_within_0_and_1(deployed, weight):
    with pytest.raises(InvalidInput) as error:
        services.adapter_canary_start(version=version(deployed, "1.1.0"), weight=weight, actor=ACTOR)
    assert error.value.param == "weight"
    assert version(deployed, "1.1.0").status == Status.READY


def test_canary_lifecycle_start_weight_promote(deployed):
    services.adapter_canary_start(version=version(deployed, "1.1.0"), weight=0.1, actor=ACTOR)
    assert state(deployed) == {"1.0.0": ("active", None), "1.1.0": ("canary", 0.1)}
    services.adapter_canary_set_weight(adapter=deployed, weight=0.5, actor=ACTOR)
    assert version(deployed, "1.1.0").traffic_weight == 0.5
    with pytest.raises(Conflict, match="already receives"):
        services.adapter_canary_set_weight(adapter=deployed, weight=0.5, actor=ACTOR)
    services.adapter_canary_promote(adapter=deployed, actor=ACTOR)
    assert state(deployed) == {"1.0.0": ("deprecated", None), "1.1.0": ("active", None)}
    events = list(DeploymentEvent.objects.filter(adapter=deployed).order_by("id"))
    assert [(e.kind, e.from_version, e.to_version, e.from_weight, e.to_weight) for e in events] == [
        ("deploy", "", "1.0.0", None, None),
        ("canary_start", "1.0.0", "1.1.0", None, 0.1),
        ("canary_weight", "1.1.0", "1.1.0", 0.1, 0.5),
        ("promote", "1.0.0", "1.1.0", 0.5, None),
    ]


def test_only_one_canary_and_not_the_active_one(deployed, make_version):
    make_version(deployed, "1.2.0")
    services.adapter_canary_start(version=version(deployed, "1.1.0"), weight=0.2, actor=ACTOR)
    with pytest.raises(Conflict, match="start another canary"):
        services.adapter_canary_start(version=version(deployed, "1.2.0"), weight=0.2, actor=ACTOR)
    with pytest.raises(Conflict, match="is the active version"):
        services.adapter_canary_start(version=version(deployed, "1.0.0"), weight=0.2, actor=ACTOR)
    assert version(deployed, "1.2.0").status == Status.READY


def test_abort_returns_traffic_to_the_active_version(deployed):
    services.adapter_canary_start(version=version(deployed, "1.1.0"), weight=0.3, actor=ACTOR)
    services.adapter_canary_abort(adapter=deployed, actor=ACTOR, reason="error rate 40%")
    assert state(deployed) == {"1.0.0": ("active", None), "1.1.0": ("deprecated", None)}
    event = DeploymentEvent.objects.filter(adapter=deployed).first()
    assert (event.kind, event.from_version, event.to_version, event.from_weight, event.reason) == (
        "abort", "1.1.0", "1.0.0", 0.3, "error rate 40%")


@pytest.mark.parametrize("operation", ["promote", "abort", "weight"])
def test_canary_operations_without_a_canary_are_refused(deployed, operation):
    call = {
        "promote": lambda: services.adapter_canary_promote(adapter=deployed, actor=ACTOR),
        "abort": lambda: services.adapter_canary_abort(adapter=deployed, actor=ACTOR),
        "weight": lambda: services.adapter_canary_set_weight(adapter=deployed, weight=0.4, actor=ACTOR),
    }[operation]
    with pytest.raises(Conflict, match="has no canary running"):
        call()
    assert kinds(deployed) == ["deploy"]


# --- rollback ---------------------------------------------------------------------------------


def test_rollback_walks_back_through_history(adapter_a, make_version):
    for text in ("1.0.0", "1.1.0", "1.2.0"):
        make_version(adapter_a, text)
    services.adapter_version_deploy(version=version(adapter_a, "1.0.0"), actor=ACTOR)
    services.adapter_version_deploy(version=version(adapter_a, "1.1.0"), actor=ACTOR)
    services.adapter_canary_start(version=version(adapter_a, "1.2.0"), weight=0.5, actor=ACTOR)
    services.adapter_canary_promote(adapter=adapter_a, actor=ACTOR)

    assert services.adapter_rollback(adapter=adapter_a, actor=ACTOR).version == "1.1.0"
    assert services.adapter_rollback(adapter=adapter_a, actor=ACTOR).version == "1.0.0"
    assert state(adapter_a) == {"1.0.0": ("active", None), "1.1.0": ("deprecated", None),
                                "1.2.0": ("deprecated", None)}
    with pytest.raises(Conflict, match="nothing earlier to roll back to"):
        services.adapter_rollback(adapter=adapter_a, actor=ACTOR)
    rollbacks = DeploymentEvent.objects.filter(adapter=adapter_a, kind="rollback").order_by("id")
    assert [(e.from_version, e.to_version) for e in rollbacks] == [("1.2.0", "1.1.0"), ("1.1.0", "1.0.0")]


def test_rollback_to_a_named_version_and_refusals(adapter_a, make_version):
    for text in ("1.0.0", "1.1.0", "1.2.0", "1.3.0"):
        make_version(adapter_a, text)
    for text in ("1.0.0", "1.1.0", "1.2.0"):
        services.adapter_version_deploy(version=version(adapter_a, text), actor=ACTOR)
    with pytest.raises(Conflict, match="is ready; a rollback returns to a version that served before"):
        services.adapter_rollback(adapter=adapter_a, actor=ACTOR, version="1.3.0")
    with pytest.raises(NotFound):
        services.adapter_rollback(adapter=adapter_a, actor=ACTOR, version="9.9.9")
    assert services.adapter_rollback(adapter=adapter_a, actor=ACTOR, version="1.0.0").version == "1.0.0"
    assert version(adapter_a, "1.2.0").status == Status.DEPRECATED


def test_rollback_refused_while_canary_runs_or_target_archived(deployed):
    services.adapter_canary_start(version=version(deployed, "1.1.0"), weight=0.5, actor=ACTOR)
    with pytest.raises(Conflict, match="before you roll back"):
        services.adapter_rollback(adapter=deployed, actor=ACTOR)
    services.adapter_canary_promote(adapter=deployed, actor=ACTOR)
    services.adapter_version_archive(version=version(deployed, "1.0.0"), actor=ACTOR)
    with pytest.raises(Conflict, match="archived"):
        services.adapter_rollback(adapter=deployed, actor=ACTOR)
    assert version(deployed, "1.1.0").status == Status.ACTIVE


# --- archive ----------------------------------------------------------------------------------


def test_archive_refuses_served_versions_and_archived_is_never_served(deployed, tenant_a):
    services.adapter_canary_start(version=version(deployed, "1.1.0"), weight=0.5, actor=ACTOR)
    with pytest.raises(Conflict, match="is active"):
        services.adapter_version_archive(version=version(deployed, "1.0.0"), actor=ACTOR)
    with pytest.raises(Conflict, match="running canary; abort it"):
        services.adapter_version_archive(version=version(deployed, "1.1.0"), actor=ACTOR)
    services.adapter_canary_abort(adapter=deployed, actor=ACTOR)
    services.adapter_version_archive(version=version(deployed, "1.1.0"), actor=ACTOR)
    with pytest.raises(Conflict, match="already archived"):
        services.adapter_version_archive(version=version(deployed, "1.1.0"), actor=ACTOR)
    with pytest.raises(Conflict, match="archived versions are never served"):
        services.adapter_canary_start(version=version(deployed, "1.1.0"), weight=0.1, actor=ACTOR)
    with pytest.raises(GatewayError) as refused:
        resolve(tenant_a, "support-bot@1.1.0")
    assert refused.value.code == "model_not_found"
    assert "support-bot@1.1.0" not in json.dumps(selectors.registry_snapshot())


# --- audit: exactly one event per change, none for a refusal -----------------------------------


def test_every_change_writes_exactly_one_event(adapter_a, make_version):
    for text in ("1.0.0", "1.1.0", "1.2.0"):
        make_version(adapter_a, text)
    steps = [
        lambda: services.adapter_version_deploy(version=version(adapter_a, "1.0.0"), actor=ACTOR),
        lambda: services.adapter_canary_start(version=version(adapter_a, "1.1.0"), weight=0.1, actor=ACTOR),
        lambda: services.adapter_canary_set_weight(adapter=adapter_a, weight=0.3, actor=ACTOR),
        lambda: services.adapter_canary_promote(adapter=adapter_a, actor=ACTOR),
        lambda: services.adapter_rollback(adapter=adapter_a, actor=ACTOR),
        lambda: services.adapter_canary_start(version=version(adapter_a, "1.2.0"), weight=0.1, actor=ACTOR),
        lambda: services.adapter_canary_abort(adapter=adapter_a, actor=ACTOR),
        lambda: services.adapter_version_archive(version=version(adapter_a, "1.2.0"), actor=ACTOR),
    ]
    for count, step in enumerate(steps, start=1):
        step()
        assert DeploymentEvent.objects.filter(adapter=adapter_a).count() == count
    assert kinds(adapter_a) == ["deploy", "canary_start", "canary_weight", "promote", "rollback", "canary_start",
                                "abort", "archive"]


def test_services_require_an_actor(deployed):
    with pytest.raises(InvalidInput, match="actor"):
        services.adapter_version_deploy(version=version(deployed, "1.1.0"), actor=" ")
    assert version(deployed, "1.1.0").status == Status.READY


# --- database constraints back the services up ------------------------------------------------


@pytest.mark.parametrize("fields", [
    {"status": "active"},
    {"status": "canary", "traffic_weight": 0.1},
    {"status": "canary", "traffic_weight": None},
    {"status": "ready", "traffic_weight": 0.1},
])
def test_database_refuses_impossible_states(deployed, make_version, fields):
    services.adapter_canary_start(version=version(deployed, "1.1.0"), weight=0.1, actor=ACTOR)
    with pytest.raises(IntegrityError), transaction.atomic():
        make_version(deployed, "3.0.0", **fields)


@pytest.mark.parametrize("operation", ["deploy", "promote", "rollback"])
def test_replacing_the_active_version_deprecates_the_old_one_by_itself(deployed, make_version, operation):
    """The services keep one active version themselves; the database's constraint only backs them
    up. With its index dropped (inside the test's transaction, so it comes back), a service that
    forgot to deprecate the old version would leave two active instead of failing on it."""
    with connection.cursor() as cursor:
        cursor.execute("DROP INDEX adapter_version_one_active")
    make_version(deployed, "1.2.0")
    services.adapter_version_deploy(version=version(deployed, "1.1.0"), actor=ACTOR)  # 1.0.0 deprecated
    if operation == "deploy":
        services.adapter_version_deploy(version=version(deployed, "1.2.0"), actor=ACTOR)
        expected = {"1.0.0": "deprecated", "1.1.0": "deprecated", "1.2.0": "active"}
    elif operation == "promote":
        services.adapter_canary_start(version=version(deployed, "1.2.0"), weight=0.2, actor=ACTOR)
        services.adapter_canary_promote(adapter=deployed, actor=ACTOR)
        expected = {"1.0.0": "deprecated", "1.1.0": "deprecated", "1.2.0": "active"}
    else:
        services.adapter_rollback(adapter=deployed, actor=ACTOR)
        expected = {"1.0.0": "active", "1.1.0": "deprecated", "1.2.0": "ready"}
    assert {name: status for name, (status, _) in state(deployed).items()} == expected
    assert deployed.versions.filter(status=Status.ACTIVE).count() == 1


@pytest.mark.parametrize("weight", [-0.01, 1.01])
def test_database_refuses_weights_outside_0_1(deployed, weight):
    with pytest.raises(IntegrityError), transaction.atomic():
        AdapterVersion.objects.filter(version="1.1.0").update(status="canary", traffic_weight=weight)


# --- deploy events on Redis -------------------------------------------------------------------


def _next_message(pubsub) -> dict:
    message = pubsub.get_message(ignore_subscribe_messages=True, timeout=5)
    assert message is not None, "no deploy event arrived"
    return json.loads(message["data"])


def test_events_stay_within_their_redis_database(deployed, redis_client, django_capture_on_commit_callbacks):
    """Redis pub/sub ignores the database a client uses; the channel's name carries it, so a registry
    on another database of the same server (another deployment, another test worker) hears nothing."""
    database = int(redis_client.connection_pool.connection_kwargs.get("db", 0))
    own, other = redis_client.pubsub(), redis_client.pubsub()
    own.subscribe(events_channel(database))
    other.subscribe(events_channel(database + 1))
    own.get_message(timeout=5)
    other.get_message(timeout=5)
    with django_capture_on_commit_callbacks(execute=True):
        services.adapter_canary_start(version=version(deployed, "1.1.0"), weight=0.1, actor=ACTOR)
    assert _next_message(own)["type"] == "canary_start"
    assert other.get_message(ignore_subscribe_messages=True, timeout=0.5) is None
    own.close()
    other.close()


def test_events_are_published_after_commit_with_the_served_set(deployed, redis_client,
                                                                django_capture_on_commit_callbacks):
    pubsub = redis_client.pubsub()
    pubsub.subscribe(events_channel(int(redis_client.connection_pool.connection_kwargs.get("db", 0))))
    pubsub.get_message(timeout=5)  # the subscription confirmation
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        services.adapter_canary_start(version=version(deployed, "1.1.0"), weight=0.1, actor=ACTOR)
    assert pubsub.get_message(ignore_subscribe_messages=True, timeout=0.2) is None, "published before commit"
    for callback in callbacks:
        callback()
    started = _next_message(pubsub)
    assert started["type"] == "canary_start" and started["tenant"] == "alice-co"
    assert (started["adapter"], started["from_version"], started["to_version"], started["to_weight"]) == (
        "support-bot", "1.0.0", "1.1.0", 0.1)
    assert {entry["name"]: entry["weight"] for entry in started["served"]} == {
        "alice-co/support-bot@1.0.0": pytest.approx(0.9), "alice-co/support-bot@1.1.0": 0.1}
    assert started["dropped"] == []

    with django_capture_on_commit_callbacks(execute=True):
        services.adapter_canary_promote(adapter=deployed, actor=ACTOR)
    promoted = _next_message(pubsub)
    assert [entry["name"] for entry in promoted["served"]] == ["alice-co/support-bot@1.1.0"]
    assert [entry["name"] for entry in promoted["dropped"]] == ["alice-co/support-bot@1.0.0"]
    assert promoted["dropped"][0]["artifact_uri"] == version(deployed, "1.0.0").artifact_uri
    assert promoted["id"] == DeploymentEvent.objects.filter(adapter=deployed).first().id
    pubsub.close()


def test_a_failed_publish_never_undoes_the_change(deployed, settings, caplog, django_capture_on_commit_callbacks):
    from tests.conftest import free_port

    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"  # nobody listens there
    with django_capture_on_commit_callbacks(execute=True):
        services.adapter_version_deploy(version=version(deployed, "1.1.0"), actor=ACTOR)
    assert version(deployed, "1.1.0").status == Status.ACTIVE
    assert "Could not publish registry event" in caplog.text


# --- deleting an adapter ----------------------------------------------------------------------


def test_delete_refused_while_serving_unless_forced(deployed, storage, tenant_a, redis_client,
                                                     django_capture_on_commit_callbacks):
    storage.put("adapters/alice-co/support-bot/1.0.0/manifest.json", b"{}")
    storage.put("adapters/alice-co/support-bot-2/1.0.0/manifest.json", b"{}")
    with pytest.raises(Conflict, match=r"is serving 1.0.0 \(active\)"):
        services.adapter_delete(adapter=deployed, actor=ACTOR)
    assert Adapter.objects.filter(pk=deployed.pk).exists()

    services.adapter_canary_start(version=version(deployed, "1.1.0"), weight=0.1, actor=ACTOR)
    pubsub = redis_client.pubsub()
    pubsub.subscribe(events_channel(int(redis_client.connection_pool.connection_kwargs.get("db", 0))))
    pubsub.get_message(timeout=5)
    with django_capture_on_commit_callbacks(execute=True):
        event = services.adapter_delete(adapter=deployed, actor=ACTOR, force=True, reason="retired")
    message = _next_message(pubsub)
    pubsub.close()
    assert (message["type"], message["served"]) == ("delete", [])
    assert sorted(entry["name"] for entry in message["dropped"]) == ["alice-co/support-bot@1.0.0",
                                                                     "alice-co/support-bot@1.1.0"]
    assert not Adapter.objects.filter(name="support-bot").exists()
    assert not AdapterVersion.objects.exists()
    event.refresh_from_db()
    assert (event.adapter, event.adapter_name, event.kind, event.from_version) == (None, "support-bot", "delete",
                                                                                   "1.0.0")
    assert DeploymentEvent.objects.filter(tenant=tenant_a.tenant, adapter_name="support-bot").count() == 3
    assert storage.list("") == ["adapters/alice-co/support-bot-2/1.0.0/manifest.json"]


def test_dry_runs_check_like_the_operation_and_change_nothing(deployed):
    """A dry run raises the operation's own refusal, and on success returns its subject untouched."""
    v1, v2 = version(deployed, "1.0.0"), version(deployed, "1.1.0")
    with pytest.raises(Conflict, match="already the active version"):
        services.adapter_version_deploy(version=v1, actor=ACTOR, dry_run=True)
    with pytest.raises(Conflict, match="has no canary running"):
        services.adapter_canary_promote(adapter=deployed, actor=ACTOR, dry_run=True)
    with pytest.raises(Conflict, match="first version"):
        services.adapter_rollback(adapter=deployed, actor=ACTOR, dry_run=True)
    with pytest.raises(InvalidInput, match="within 0 and 1"):
        services.adapter_canary_start(version=v2, weight=1.5, actor=ACTOR, dry_run=True)
    assert services.adapter_version_deploy(version=v2, actor=ACTOR, dry_run=True).pk == v2.pk
    assert services.adapter_canary_start(version=v2, weight=None, actor=ACTOR, dry_run=True).pk == v2.pk
    assert services.adapter_version_archive(version=v2, actor=ACTOR, dry_run=True).pk == v2.pk
    assert state(deployed) == {"1.0.0": ("active", None), "1.1.0": ("ready", None)}
    services.adapter_canary_start(version=v2, weight=0.2, actor=ACTOR)
    with pytest.raises(Conflict, match="promote or abort it before you roll back"):
        services.adapter_rollback(adapter=deployed, actor=ACTOR, dry_run=True)
    with pytest.raises(Conflict, match="already receives"):
        services.adapter_canary_set_weight(adapter=deployed, weight=0.2, actor=ACTOR, dry_run=True)
    assert services.adapter_canary_abort(adapter=deployed, actor=ACTOR, dry_run=True).pk == v2.pk
    assert services.adapter_canary_promote(adapter=deployed, actor=ACTOR, dry_run=True).pk == v2.pk
    assert state(deployed) == {"1.0.0": ("active", None), "1.1.0": ("canary", 0.2)}
    assert kinds(deployed) == ["deploy", "canary_start"]
