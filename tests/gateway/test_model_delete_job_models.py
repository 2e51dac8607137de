"""Issue 37, item 8: `DELETE /v1/models/{id}` on a fine-tuning job's models (serving.gateway.model_delete).
A kept checkpoint that the same key can call was answered "does not exist"; it is now refused saying
what it is and why it cannot be deleted this way. A job's `ft:` name deletes the version it stands for.
In-process, as the gateway's view calls it; the route itself: tests/gateway/test_model_delete_e2e.py."""

from __future__ import annotations

import pytest

from serving.gateway.errors import GatewayError
from serving.gateway.model_delete import model_delete
from serving.registry.models import Adapter, AdapterVersion
from training.models import Checkpoint, TrainingJob

pytestmark = pytest.mark.django_db

BASE = "org/tiny-llama"


@pytest.fixture
def job(tenant_a, settings) -> TrainingJob:
    settings.BASE_MODEL_NAME = BASE
    settings.BASE_MODEL_REVISION = ""
    job = TrainingJob.objects.create(tenant=tenant_a.tenant, adapter_name="ckpt-bot", base_model=BASE, seed=1,
                                     status=TrainingJob.Status.SUCCEEDED)
    Checkpoint.objects.create(job=job, step=8, storage_prefix=f"checkpoints/alice-co/{job.pk}/step-8",
                              artifact_uri=f"file:///storage/checkpoints/alice-co/{job.pk}/step-8-adapter/",
                              manifest_sha256=f"{8:064d}")
    adapter = Adapter.objects.create(tenant=tenant_a.tenant, name="ckpt-bot")
    version = AdapterVersion.objects.create(
        adapter=adapter, version="1.0.0", artifact_uri="file:///storage/v/", manifest_sha256="a" * 64, base_model=BASE,
        rank=4, lora_alpha=8, target_modules=["q_proj"], size_bytes=1, source="training_job", source_id=str(job.pk))
    TrainingJob.objects.filter(pk=job.pk).update(adapter_version=version)
    job.refresh_from_db()
    return job


def refusal(key: str, model: str) -> GatewayError:
    with pytest.raises(GatewayError) as raised:
        model_delete(f"Bearer {key}", model, {})
    return raised.value


def test_a_served_checkpoint_is_refused_as_a_checkpoint_not_as_missing(job, tenant_a, tenant_b):
    for model in (f"ft:{BASE}:alice-co:ckpt-bot:ftjob-{job.pk}:ckpt-step-8", f"ckpt-bot@ftjob-{job.pk}:ckpt-step-8"):
        error = refusal(tenant_a.key, model)
        assert (error.status, error.code, error.param) == (403, "checkpoint_not_deletable", "model"), error.message
        assert f"checkpoint of fine-tuning job ftjob-{job.pk}" in error.message
        assert "'ckpt-bot@1.0.0'" in error.message  # what can be deleted instead
    assert Checkpoint.objects.filter(job=job).count() == 1
    # Another tenant's checkpoint, and a step the job never kept: as missing as a name that never was.
    assert refusal(tenant_b.key, f"ckpt-bot@ftjob-{job.pk}:ckpt-step-8").code == "model_not_found"
    assert refusal(tenant_a.key, f"ckpt-bot@ftjob-{job.pk}:ckpt-step-16").code == "model_not_found"


def test_a_jobs_ft_name_deletes_the_version_it_stands_for(job, tenant_a):
    model = f"ft:{BASE}:alice-co:ckpt-bot:ftjob-{job.pk}"
    assert model_delete(f"Bearer {tenant_a.key}", model, {}) == {"id": model, "object": "model", "deleted": True}
    assert AdapterVersion.objects.get(pk=job.adapter_version_id).status == AdapterVersion.Status.ARCHIVED
    assert refusal(tenant_a.key, model).code == "model_not_found"  # deleted before


def job_of(tenant, adapter_name: str, version: str) -> TrainingJob:
    """A finished job of `tenant` and the registry version it made (active: deleting it needs force)."""
    job = TrainingJob.objects.create(tenant=tenant, adapter_name=adapter_name, base_model=BASE, seed=1,
                                     status=TrainingJob.Status.SUCCEEDED)
    adapter, _ = Adapter.objects.get_or_create(tenant=tenant, name=adapter_name)
    made = AdapterVersion.objects.create(
        adapter=adapter, version=version, artifact_uri="file:///storage/w/", manifest_sha256="b" * 64,
        base_model=BASE, rank=4, lora_alpha=8, target_modules=["q_proj"], size_bytes=1, source="training_job",
        source_id=str(job.pk))
    TrainingJob.objects.filter(pk=job.pk).update(adapter_version=made)
    job.refresh_from_db()
    return job


def test_another_tenants_adapter_and_jobs_are_as_missing_as_names_that_never_were(job, tenant_a, tenant_b):
    """Tenant isolation at each lookup: bob-co names alice-co's adapter (it has one of that name too),
    its version, and alice-co's job by bob-co's own ft: name; alice-co's versions are untouched."""
    bobs = job_of(tenant_b.tenant, "ckpt-bot", "2.0.0")
    alices = AdapterVersion.objects.get(pk=job.adapter_version_id)
    for model in ("ckpt-bot@1.0.0", f"ft:{BASE}:bob-co:ckpt-bot:ftjob-{job.pk}", f"ckpt-bot@ftjob-{job.pk}"):
        assert refusal(tenant_b.key, model).code == "model_not_found", model
    # The adapter name alone is bob-co's own: it archives bob-co's version, never alice-co's.
    assert model_delete(f"Bearer {tenant_b.key}", "ckpt-bot", {"force": ["true"]})["deleted"] is True
    assert AdapterVersion.objects.get(pk=bobs.adapter_version_id).status == AdapterVersion.Status.ARCHIVED
    alices.refresh_from_db()
    assert alices.status != AdapterVersion.Status.ARCHIVED


def test_an_ft_name_naming_another_tenant_is_missing_even_for_the_callers_own_job(tenant_b):
    own = job_of(tenant_b.tenant, "bob-bot", "1.0.0")
    assert refusal(tenant_b.key, f"ft:{BASE}:alice-co:bob-bot:ftjob-{own.pk}").code == "model_not_found"
    assert AdapterVersion.objects.get(pk=own.adapter_version_id).status != AdapterVersion.Status.ARCHIVED
    assert model_delete(f"Bearer {tenant_b.key}", f"ft:{BASE}:bob-co:bob-bot:ftjob-{own.pk}", {"force": ["true"]})[
        "deleted"] is True
