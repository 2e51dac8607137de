"""Issue 37, item 8: `DELETE /v1/models/{id}` on a fine-tuning job's models (serving.gateway.model_delete).
A kept checkpoint that the same key can call was answered "does not exist"; it is now refused saying
what it is and why it cannot be deleted this way. A job's `ft:` name deletes the version it stands for.
In-process, as the gateway's view calls it; the route itself: tests/gateway/test_model_delete_e2e.py."""

from __future__ import annotations

import pytest

from serving.gateway.errors import GatewayError
from serving.gateway.model_delete import model_delete
from serving.models import Adapter, AdapterVersion
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
