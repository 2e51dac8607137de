"""Registry sync on real parts: the Django registry (live server, its snapshot endpoint), Redis
pub/sub for deploy events, moto S3 for the artifacts. A deploy event makes the worker fetch the
artifact and serve it; a deploy whose event was lost is healed by the periodic reconcile; a
rollback's event swaps the versions; the worker's registration in Redis shows what it serves."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from serving.registry import services
from serving.engine import LoRARequest, SamplingParams
from serving.contracts.registry import WORKERS_KEY, events_channel, worker_key

pytestmark = pytest.mark.django_db(transaction=True)

TOKEN = "registry-test-token"
WORKER_ID = "sync-test-worker"
# Short, so the waits for a reconcile (a refused snapshot, a lost event healed) are short; the
# reconciles run one after another whatever the interval, which is all the test relies on.
RECONCILE_S = 1


@pytest.fixture
def registry(settings, tiny_model: Path, s3_bucket: str, moto_s3_endpoint: str, live_server) -> str:
    """The platform configured around the tiny base and moto S3; the snapshot URL."""
    settings.BASE_MODEL_PATH = tiny_model
    settings.BASE_MODEL_NAME = tiny_model.name
    settings.BASE_MODEL_ALIASES = []
    settings.MAX_LORA_RANK = 32
    settings.STORAGE_URL = f"s3://{s3_bucket}/platform"
    settings.S3_ENDPOINT_URL = moto_s3_endpoint
    settings.REGISTRY_TOKEN = TOKEN
    return f"{live_server.url}/api/v1/internal/registry/snapshot"


def upload(adapter, directory: Path, version: str):
    files = [SimpleUploadedFile(name, (directory / name).read_bytes())
             for name in ("adapter_config.json", "adapter_model.safetensors")]
    return services.adapter_version_upload(adapter=adapter, files=files, actor="test", version=version)


def served_models(worker) -> set[str]:
    return {model["id"] for model in httpx.get(f"{worker.url}/v1/models", timeout=10).json()["data"]}


def wait_for(condition, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the worker did not converge"
        time.sleep(0.2)


def events_subscribers(redis_client) -> int:
    channel = events_channel(int(redis_client.connection_pool.connection_kwargs.get("db", 0)))
    return dict(redis_client.pubsub_numsub(channel)).get(channel.encode(), 0)


def snapshots_refused(settings, worker) -> None:
    """From now until the token is put back, every snapshot the worker asks for is refused, so only a
    deploy event can change what it serves. The wait ends once one was refused: the reconciles run
    one after another, so none still in flight can apply a snapshot taken after this."""
    refused = worker.metric("loraplex_registry_snapshot_failures_total")
    settings.REGISTRY_TOKEN = "not-the-workers-token"
    wait_for(lambda: worker.metric("loraplex_registry_snapshot_failures_total") > refused)


def test_deploy_events_and_reconcile_keep_the_worker_in_sync(
    registry, settings, redis_client, tenant_a, start_worker, make_adapter, offline, tiny_model
):
    """Each path alone: while the worker's snapshots are refused (the live server's token changed
    under it), a deploy or rollback reaches it only as an event; while events are lost, only the
    reconcile. (Both open, the periodic reconcile may apply a deploy before its event arrives, and the
    worker then rightly skips the event: waiting for the event would flake.)"""
    subscribed = events_subscribers(redis_client)
    worker = start_worker(
        "--allowed-adapter-path", settings.STORAGE_URL, "--registry-url", registry, "--registry-token", TOKEN, "--redis-url", settings.REDIS_URL,
        "--registry-reconcile-interval", str(RECONCILE_S), "--heartbeat-interval", "1",
        "--worker-id", WORKER_ID, "--served-model-name", tiny_model.name,
    )
    first_dir = make_adapter(r=8, target_modules=("q_proj", "v_proj"), seed=31)
    second_dir = make_adapter(r=16, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"), seed=32)
    adapter = services.adapter_create(tenant=tenant_a.tenant, name="support-bot")
    v1 = upload(adapter, first_dir, "1.0.0")
    first, second = "alice-co/support-bot@1.0.0", "alice-co/support-bot@1.1.0"

    # 1. A deploy event: the worker downloads the artifact from S3 and serves it.
    wait_for(lambda: worker.metric("loraplex_registry_snapshots_total") >= 1)
    wait_for(lambda: events_subscribers(redis_client) > subscribed)  # an event published now is heard
    snapshots_refused(settings, worker)
    events, snapshots = worker.metric("loraplex_registry_events_total"), worker.metric("loraplex_registry_snapshots_total")
    services.adapter_version_deploy(version=v1, actor="test")
    wait_for(lambda: first in served_models(worker))
    assert worker.metric("loraplex_registry_events_total") == events + 1
    assert worker.metric("loraplex_registry_snapshots_total") == snapshots
    greedy = SamplingParams(temperature=0, max_tokens=10)
    expected = offline.generate("Hello there", greedy, LoRARequest("first-local", str(first_dir)))[0]
    reply = httpx.post(f"{worker.url}/v1/completions", timeout=60, json={
        "model": first, "prompt": "Hello there", "max_tokens": 10, "temperature": 0, "return_token_ids": True})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["token_ids"] == expected.outputs[0].token_ids

    # The registration the gateway routes by says what this worker serves.
    def registration() -> dict | None:
        raw = redis_client.get(worker_key(WORKER_ID))
        return json.loads(raw) if raw else None

    wait_for(lambda: first in {a["name"] for a in (registration() or {}).get("adapters", [])})
    entry = registration()
    assert entry["url"] == worker.url and entry["state"] == "ready" and entry["base_model"] == tiny_model.name
    assert redis_client.ttl(worker_key(WORKER_ID)) > 0
    assert redis_client.zscore(WORKERS_KEY, WORKER_ID) is not None

    # 2. A deploy whose event is lost (Redis unreachable when it is published): reconcile heals it.
    settings.REGISTRY_TOKEN = TOKEN
    v2 = upload(adapter, second_dir, "1.1.0")
    wait_for(lambda: worker.metric("loraplex_registry_revision") >= _last_event_id(adapter))
    events = worker.metric("loraplex_registry_events_total")
    snapshots = worker.metric("loraplex_registry_snapshots_total")
    reachable = settings.REDIS_URL
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    services.adapter_version_deploy(version=v2, actor="test")
    settings.REDIS_URL = reachable
    wait_for(lambda: second in served_models(worker) and first not in served_models(worker))
    assert worker.metric("loraplex_registry_events_total") == events
    assert worker.metric("loraplex_registry_snapshots_total") > snapshots

    # 3. A rollback's event: back to 1.0.0, and 1.1.0 is dropped.
    snapshots_refused(settings, worker)
    services.adapter_rollback(adapter=adapter, actor="test")
    wait_for(lambda: first in served_models(worker) and second not in served_models(worker))
    assert worker.metric("loraplex_registry_events_total") == events + 1
    assert worker.metric("loraplex_registry_load_failures_total") == 0

    # Leaving: the registration goes with the worker.
    assert worker.stop() == 0
    assert registration() is None
    assert redis_client.zscore(WORKERS_KEY, WORKER_ID) is None


def _last_event_id(adapter) -> int:
    from serving.registry.models import DeploymentEvent

    return DeploymentEvent.objects.order_by("-id").values_list("id", flat=True).first()


OPERATOR_KEY = "operator-key-for-sync-tests"


def test_reconcile_restores_registry_names_whoever_changed_them(
    registry, settings, tenant_a, start_worker, make_adapter, offline, tiny_model, tmp_path_factory
):
    """An attack on the registry's names: a served version's name loaded over in place with other weights.
    The operator may do it (the gateway is the operator); the reconcile the change sets off puts
    the registry's weights back and drops a registry name the registry does not serve. Other
    names stay."""
    served_dir = make_adapter(r=8, target_modules=("q_proj", "v_proj"), seed=51)
    hijack_dir = make_adapter(r=8, target_modules=("q_proj", "v_proj"), seed=52)
    adapter = services.adapter_create(tenant=tenant_a.tenant, name="support-bot")
    deployed = upload(adapter, served_dir, "1.0.0")
    services.adapter_version_deploy(version=deployed, actor="test")
    upload(adapter, hijack_dir, "2.0.0")  # ready, never deployed
    # Reconciles a minute apart, no deploy events: what happens within the test's waits is the
    # reconcile the operator's change itself sets off.
    worker = start_worker(
        "--api-key", OPERATOR_KEY, "--allowed-adapter-path", settings.STORAGE_URL,
        "--allowed-adapter-path", str(tmp_path_factory.getbasetemp()),
        "--registry-url", registry, "--registry-token", TOKEN,
        "--registry-reconcile-interval", "60", "--served-model-name", tiny_model.name,
    )
    http = httpx.Client(base_url=worker.url, timeout=60, headers={"Authorization": f"Bearer {OPERATOR_KEY}"})
    name, undeployed = "alice-co/support-bot@1.0.0", "alice-co/support-bot@2.0.0"
    greedy = SamplingParams(temperature=0, max_tokens=10)

    def expected(directory: Path) -> list[int]:
        return offline.generate("Hello there", greedy, LoRARequest(directory.name, str(directory)))[0].outputs[0].token_ids

    def generated(model: str) -> list[int] | None:
        reply = http.post("/v1/completions", json={
            "model": model, "prompt": "Hello there", "max_tokens": 10, "temperature": 0, "return_token_ids": True})
        return reply.json()["choices"][0]["token_ids"] if reply.status_code == 200 else None

    def models() -> set[str]:
        return {card["id"] for card in http.get("/v1/models").json()["data"]}

    try:
        wait_for(lambda: name in models())
        assert expected(served_dir) != expected(hijack_dir)
        assert generated(name) == expected(served_dir)

        replaced = http.post("/v1/load_lora_adapter",
                             json={"lora_name": name, "lora_path": str(hijack_dir), "load_inplace": True})
        assert replaced.status_code == 200, replaced.text
        assert replaced.json()["digest"] != deployed.manifest_sha256  # the weights were replaced
        loaded = http.post("/v1/load_lora_adapter", json={"lora_name": undeployed, "lora_path": str(hijack_dir)})
        assert loaded.status_code == 200, loaded.text
        mine = http.post("/v1/load_lora_adapter", json={"lora_name": "operators-own", "lora_path": str(hijack_dir)})
        assert mine.status_code == 200, mine.text

        wait_for(lambda: generated(name) == expected(served_dir), timeout=30)
        wait_for(lambda: undeployed not in models(), timeout=30)
        assert "operators-own" in models() and name in models()
        assert generated("operators-own") == expected(hijack_dir)
        assert f"registry version {name} is loaded with digest" in worker.log()
    finally:
        http.close()
