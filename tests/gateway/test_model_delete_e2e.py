"""`DELETE /v1/models/{id}` with the official `openai` SDK through the real web process and a real
serving worker: a tenant deletes its own fine-tuned model (archived through the registry, audited),
a served one only when forced; another tenant's model is the same 404 as a missing one; the base
model and a key without the `manage` scope are refused (serving.gateway.model_delete). No request
here needs a worker to answer: what is checked is decided by the gateway."""

from __future__ import annotations

import httpx
import openai
import pytest

from serving.registry import services
from serving.registry.models import AdapterVersion, DeploymentEvent
from tenants.services import api_key_create
from tests.gateway.conftest import upload_version

pytestmark = pytest.mark.django_db(transaction=True)

HELLO = [{"role": "user", "content": "Say hello"}]
FORCE = {"force": "true"}
# Over the tier's limit: the gateway resolves (and caches) the model, then refuses with a 400 of
# its own, so the request shows what the model names without a worker's answer.
OVER_TIER = 10**6


def resolves(api: openai.OpenAI, model: str) -> bool:
    """Whether the gateway serves `model` to this caller (a 400 for the tier's limit) or not (404)."""
    try:
        api.chat.completions.create(model=model, messages=HELLO, max_tokens=OVER_TIER)
    except openai.BadRequestError as refused:
        assert refused.body["code"] == "max_tokens_exceeded", refused.body
        return True
    except openai.NotFoundError as missing:
        assert missing.body["code"] == "model_not_found", missing.body
        return False
    raise AssertionError(f"{model}: the tier's limit did not refuse max_tokens={OVER_TIER}")


def client(web, key: str) -> openai.OpenAI:
    # No retries: the SDK retries a 409, and each refusal here must be seen once.
    return openai.OpenAI(base_url=f"{web.url}/v1", api_key=key, max_retries=0, timeout=120)


@pytest.fixture
def deployed(registry, tenant_a, adapter_dirs):
    """support-bot: 1.0.0 active, 1.1.0 ready."""
    adapter = services.adapter_create(tenant=tenant_a.tenant, name="support-bot")
    active = upload_version(adapter, adapter_dirs[0], "1.0.0")
    upload_version(adapter, adapter_dirs[1], "1.1.0")
    services.adapter_version_deploy(version=active, actor="test")
    return adapter


def statuses(adapter) -> dict[str, str]:
    return dict(AdapterVersion.objects.filter(adapter=adapter).values_list("version", "status"))


def archive_events(adapter) -> list[tuple[str, str, str]]:
    return list(DeploymentEvent.objects.filter(adapter=adapter, kind=DeploymentEvent.Kind.ARCHIVE).order_by("id")
                .values_list("to_version", "actor", "reason"))


def prefix_of(key: str) -> str:
    return key.removeprefix("lp-").partition(".")[0]


def test_a_served_model_is_refused_then_deleted_by_force_and_is_gone(web, tenant_a, deployed):
    api = client(web, tenant_a.key)
    assert resolves(api, "support-bot")  # now cached in the web process

    with pytest.raises(openai.ConflictError) as refused:
        api.models.delete("support-bot")
    error = refused.value.body
    assert (error["code"], error["type"]) == ("adapter_serving", "conflict_error")
    assert "1.0.0 (active)" in error["message"] and "?force=true" in error["message"]
    assert statuses(deployed) == {"1.0.0": "active", "1.1.0": "ready"}

    deleted = api.models.delete("support-bot", extra_query={**FORCE, "reason": "replaced by v2"})
    assert (deleted.id, deleted.object, deleted.deleted) == ("support-bot", "model", True)
    assert statuses(deployed) == {"1.0.0": "archived", "1.1.0": "archived"}
    actor = f"api-key:{prefix_of(tenant_a.key)}"
    assert archive_events(deployed) == [("1.0.0", actor, "replaced by v2"), ("1.1.0", actor, "replaced by v2")]

    assert {model.id for model in api.models.list()} == {deployed.versions.first().base_model}
    assert not resolves(api, "support-bot") and not resolves(api, "support-bot@1.0.0")
    with pytest.raises(openai.NotFoundError) as again:
        api.models.delete("support-bot")
    assert again.value.body["code"] == "model_not_found"


def test_one_version_is_deleted_by_its_pinned_name(web, tenant_a, deployed):
    api = client(web, tenant_a.key)
    assert api.models.delete("support-bot@1.1.0").deleted is True
    assert statuses(deployed) == {"1.0.0": "active", "1.1.0": "archived"}
    assert archive_events(deployed) == [("1.1.0", f"api-key:{prefix_of(tenant_a.key)}",
                                         "DELETE /v1/models/support-bot@1.1.0")]
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("support-bot@1.1.0")
    with pytest.raises(openai.ConflictError) as refused:
        api.models.delete("support-bot@1.0.0")
    assert refused.value.body["code"] == "version_serving"
    assert resolves(api, "support-bot")


def test_another_tenants_model_is_the_same_404_as_a_missing_one(web, tenant_a, tenant_b, deployed):
    bob = client(web, tenant_b.key)
    bodies = {}
    for model in ("support-bot", "support-bot@1.0.0", "no-such-adapter", "no-such-adapter@1.0.0"):
        with pytest.raises(openai.NotFoundError) as missing:
            bob.models.delete(model, extra_query=FORCE)
        bodies[model] = missing.value.body
    assert {body["message"].replace(model, "<model>") for model, body in bodies.items()} == {
        "The model '<model>' does not exist or you do not have access to it."}
    assert {(body["type"], body["code"], body["param"]) for body in bodies.values()} == {
        ("invalid_request_error", "model_not_found", "model")}
    assert statuses(deployed) == {"1.0.0": "active", "1.1.0": "ready"} and archive_events(deployed) == []


def test_the_base_model_and_a_key_without_the_manage_scope_are_refused(web, tenant_a, deployed):
    base = deployed.versions.first().base_model
    with pytest.raises(openai.PermissionDeniedError) as refused:
        client(web, tenant_a.key).models.delete(base)
    assert (refused.value.body["code"], refused.value.body["param"]) == ("model_not_deletable", "model")

    _, inference_only = api_key_create(tenant=tenant_a.tenant, name="app", scopes=["inference"])
    reader = client(web, inference_only)
    assert "support-bot" in {model.id for model in reader.models.list()}
    with pytest.raises(openai.PermissionDeniedError) as scoped:
        reader.models.delete("support-bot", extra_query=FORCE)
    assert scoped.value.body["code"] == "insufficient_scope" and "'manage' scope" in scoped.value.body["message"]
    assert statuses(deployed) == {"1.0.0": "active", "1.1.0": "ready"}


def test_bad_query_parameters_and_other_methods_are_named(web, tenant_a, deployed):
    headers = {"Authorization": f"Bearer {tenant_a.key}"}
    for query, param in (("force=maybe", "force"), ("forse=true", "forse"), ("force=true&force=false", "force")):
        refused = httpx.delete(f"{web.url}/v1/models/support-bot?{query}", headers=headers, timeout=30)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.text
    put = httpx.put(f"{web.url}/v1/models/support-bot", headers=headers, timeout=30)
    assert put.status_code == 405 and put.headers["allow"] == "GET, DELETE"
    assert put.json()["error"]["code"] == "method_not_allowed"
    assert statuses(deployed) == {"1.0.0": "active", "1.1.0": "ready"}
