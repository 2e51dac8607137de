"""What the gateway's catalog makes of a fine-tuning job's model names (serving.contracts.checkpoint_names):
a kept checkpoint by OpenAI's `ft:` name and our pinned form, a job's version by its `ft:` name, for
the key's tenant only, within the key's allow-list, and the names it refuses.

Calling a checkpoint through a real gateway and worker: tests/training/test_checkpoint_models_e2e.py.
"""

from __future__ import annotations

import pytest

from serving.contracts.checkpoint_names import job_model_parse
from serving.gateway import catalog
from serving.gateway.errors import GatewayError
from serving.registry import job_models
from serving.registry.models import Adapter, AdapterVersion
from tenants.services import api_key_create
from training.job_models import TrainingJobModels
from training.models import Checkpoint, TrainingJob

pytestmark = pytest.mark.django_db

BASE = "org/tiny-llama"


@pytest.fixture
def job(tenant_a, settings) -> TrainingJob:
    settings.BASE_MODEL_NAME = BASE
    settings.BASE_MODEL_REVISION = ""
    job = TrainingJob.objects.create(tenant=tenant_a.tenant, adapter_name="ckpt-bot", base_model=BASE, seed=1,
                                     status=TrainingJob.Status.RUNNING)
    for step in (8, 16):
        Checkpoint.objects.create(job=job, step=step, storage_prefix=f"checkpoints/alice-co/{job.pk}/step-{step}",
                                  artifact_uri=f"file:///storage/checkpoints/alice-co/{job.pk}/step-{step}-adapter/",
                                  manifest_sha256=f"{step:064d}")
    # Saved before checkpoints had artifacts: a resume point only.
    Checkpoint.objects.create(job=job, step=4, storage_prefix=f"checkpoints/alice-co/{job.pk}/step-4")
    return job


def resolve(key: str, model: str):
    return catalog._load_target(catalog._load_caller(f"Bearer {key}"), model)


def refusal(key: str, model: str) -> GatewayError:
    with pytest.raises(GatewayError) as raised:
        resolve(key, model)
    return raised.value


def test_a_checkpoint_resolves_by_either_name_to_its_artifact_for_its_tenant_only(job, tenant_a, tenant_b):
    for model in (f"ft:{BASE}:alice-co:ckpt-bot:ftjob-{job.pk}:ckpt-step-16", f"ckpt-bot@ftjob-{job.pk}:ckpt-step-16"):
        pinned = resolve(tenant_a.key, model).pinned
        assert pinned.qualified_name == f"alice-co/ckpt-bot@ftjob-{job.pk}:ckpt-step-16"
        assert (pinned.artifact_uri, pinned.manifest_sha256) == (
            f"file:///storage/checkpoints/alice-co/{job.pk}/step-16-adapter/", f"{16:064d}")
    missing = [f"ft:{BASE}:alice-co:ckpt-bot:ftjob-{job.pk}:ckpt-step-12",  # no such step
               f"ft:{BASE}:alice-co:ckpt-bot:ftjob-{job.pk}:ckpt-step-4",  # no artifact
               f"ft:other-base:alice-co:ckpt-bot:ftjob-{job.pk}:ckpt-step-16",
               f"ft:{BASE}:alice-co:other-bot:ftjob-{job.pk}:ckpt-step-16",
               f"ft:{BASE}:bob-co:ckpt-bot:ftjob-{job.pk}:ckpt-step-16",
               f"ckpt-bot@ftjob-{job.pk + 1}:ckpt-step-16"]
    for model in missing:
        assert refusal(tenant_a.key, model).code == "model_not_found", model
    # Bob's key: alice's checkpoint is as missing as one that never was, under every spelling.
    for model in (f"ft:{BASE}:alice-co:ckpt-bot:ftjob-{job.pk}:ckpt-step-16",
                  f"ft:{BASE}:bob-co:ckpt-bot:ftjob-{job.pk}:ckpt-step-16", f"ckpt-bot@ftjob-{job.pk}:ckpt-step-16"):
        error = refusal(tenant_b.key, model)
        assert (error.status, error.code) == (404, "model_not_found"), model


def test_a_jobs_ft_name_is_its_version_and_a_key_allow_list_covers_its_models(job, tenant_a):
    adapter = Adapter.objects.create(tenant=tenant_a.tenant, name="ckpt-bot")
    version = AdapterVersion.objects.create(
        adapter=adapter, version="1.0.0", artifact_uri="file:///storage/v/", manifest_sha256="a" * 64, base_model=BASE,
        rank=4, lora_alpha=8, target_modules=["q_proj"], size_bytes=1, source="training_job", source_id=str(job.pk))
    TrainingJob.objects.filter(pk=job.pk).update(adapter_version=version, status=TrainingJob.Status.SUCCEEDED)
    assert resolve(tenant_a.key, f"ft:{BASE}:alice-co:ckpt-bot:ftjob-{job.pk}").pinned.version == "1.0.0"

    checkpoint = f"ft:{BASE}:alice-co:ckpt-bot:ftjob-{job.pk}:ckpt-step-8"
    _, allowed = api_key_create(tenant=tenant_a.tenant, name="bot only", controls={"allowed_models": ["ckpt-bot"]})
    assert resolve(allowed, checkpoint).pinned.version == f"ftjob-{job.pk}:ckpt-step-8"
    _, pinned_only = api_key_create(tenant=tenant_a.tenant, name="one checkpoint",
                                    controls={"allowed_models": [f"ckpt-bot@ftjob-{job.pk}:ckpt-step-8"]})
    assert resolve(pinned_only, checkpoint).pinned is not None
    assert refusal(pinned_only, f"ft:{BASE}:alice-co:ckpt-bot:ftjob-{job.pk}:ckpt-step-16").code == "model_not_allowed"
    _, other = api_key_create(tenant=tenant_a.tenant, name="other", controls={"allowed_models": ["other-bot"]})
    assert refusal(other, checkpoint).code == "model_not_allowed"

    AdapterVersion.objects.filter(pk=version.pk).update(status=AdapterVersion.Status.ARCHIVED)
    assert refusal(tenant_a.key, f"ft:{BASE}:alice-co:ckpt-bot:ftjob-{job.pk}").code == "model_not_found"


def test_a_checkpoint_of_another_base_revision_is_refused_naming_both(job, tenant_a, settings):
    TrainingJob.objects.filter(pk=job.pk).update(base_model_revision="a" * 40)
    settings.BASE_MODEL_REVISION = "b" * 40
    error = refusal(tenant_a.key, f"ckpt-bot@ftjob-{job.pk}:ckpt-step-8")
    assert (error.status, error.code) == (409, "base_model_revision_mismatch")
    assert "a" * 40 in error.message and "b" * 40 in error.message


def test_the_playground_lists_the_kept_checkpoints_with_artifacts_newest_first(job, tenant_a, tenant_b):
    listed = [item.model for item in catalog.servable_models(tenant_a.tenant.pk) if item.kind == "checkpoint"]
    assert listed == [f"ckpt-bot@ftjob-{job.pk}:ckpt-step-16", f"ckpt-bot@ftjob-{job.pk}:ckpt-step-8"]
    assert not [item for item in catalog.servable_models(tenant_b.tenant.pk) if item.kind == "checkpoint"]


def test_the_catalog_asks_training_only_through_the_registrys_hook(job, tenant_a, monkeypatch):
    """Serving never imports training: training registers its answer (training.apps); without it a
    job's names are models that do not exist, and no checkpoint is listed."""
    assert isinstance(job_models.job_models(), TrainingJobModels)
    monkeypatch.setattr(job_models, "_provider", [job_models._NoJobs()])
    for model in (f"ckpt-bot@ftjob-{job.pk}:ckpt-step-16", f"ft:{BASE}:alice-co:ckpt-bot:ftjob-{job.pk}:ckpt-step-16"):
        assert refusal(tenant_a.key, model).code == "model_not_found", model
    assert not [item for item in catalog.servable_models(tenant_a.tenant.pk) if item.kind == "checkpoint"]


@pytest.mark.parametrize("model", [
    "ft:base:t:a:ftjob-x:ckpt-step-1", "ft:base:t:a:job-1:ckpt-step-1", "ft::t:a:ftjob-1", "ft:base:t:a",
    "a@ftjob-1:ckpt-step-", "a@ckpt-step-1", "@ftjob-1:ckpt-step-1", "a@1.0.0", "a",
])
def test_names_in_neither_form_are_left_to_the_registry(model):
    assert job_model_parse(model) is None


def test_an_openai_name_is_read_from_the_right_so_a_base_id_may_hold_colons():
    named = job_model_parse("ft:org/model:v2:alice-co:bot:ftjob-12:ckpt-step-40")
    assert (named.base, named.tenant, named.adapter, named.job_id, named.step) == ("org/model:v2", "alice-co", "bot",
                                                                                    12, 40)
    assert named.pinned == "bot@ftjob-12:ckpt-step-40"
