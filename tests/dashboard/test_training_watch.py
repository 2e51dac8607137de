"""Training a newcomer can watch (issue 39, item 6), in-process: the form offers the base model's own
projections (read from its weights, so a Phi-3-shaped base offers qkv_proj and gate_up_proj, a Llama
one q_proj … down_proj) and refuses one the base lacks; DPO's beta shows only with DPO, and a beta
typed before switching back to supervised is not sent; the job page shows tokens/s and the time left,
says what the job is doing before its first step, and charts validation only for a job that has it."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.urls import reverse
from django.utils import timezone

from serving.engine.tiny import build_tiny_model
from training import datasets
from training.models import Dataset, TrainingEvent, TrainingJob

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("fast_passwords")]

CHAT = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bases")
    return {arch: build_tiny_model(root / arch, arch=arch, size="tiny", seed=0) for arch in ("llama", "phi3")}


@pytest.fixture(autouse=True)
def storage(settings, tmp_path):
    settings.STORAGE_URL = f"file://{tmp_path / 'storage'}"
    settings.S3_ENDPOINT_URL = None
    settings.BASE_MODEL_PATH = tmp_path / "no-model"


def ready(tenant) -> Dataset:
    content = (json.dumps(CHAT) + "\n").encode() * 12
    created = datasets.dataset_create(tenant=tenant, source=SimpleUploadedFile("data.jsonl", content),
                                      filename="data.jsonl", size=len(content))
    dataset = datasets.dataset_validate(dataset_id=created.pk)
    assert dataset.status == "ready", dataset.report
    return dataset


def offered_targets(page: str) -> list[str]:
    return [part.split('"', 1)[0] for part in page.split('name="target_modules" value="')[1:]]


def test_the_form_offers_the_base_models_own_projections(as_user, people, tenant_a, settings, bases):
    ready(tenant_a.tenant)
    client = as_user(people.member)
    settings.BASE_MODEL_PATH = bases["phi3"]
    assert offered_targets(client.get(reverse("dashboard:job-new")).content.decode()) == [
        "all-linear", "o_proj", "down_proj", "qkv_proj", "gate_up_proj", "embed_tokens", "lm_head"]
    settings.BASE_MODEL_PATH = bases["llama"]
    assert offered_targets(client.get(reverse("dashboard:job-new")).content.decode()) == [
        "all-linear", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "embed_tokens",
        "lm_head"]


def test_a_module_the_base_lacks_is_refused_with_the_ones_it_has(as_user, people, tenant_a, settings, bases):
    dataset = ready(tenant_a.tenant)
    settings.BASE_MODEL_PATH = bases["phi3"]
    refused = as_user(people.member).post(reverse("dashboard:job-create"), {
        "training_file": str(dataset.pk), "adapter": "bot", "target_modules": ["q_proj", "o_proj"]})
    assert refused.status_code == 400
    assert (b"The base model has no q_proj; its projections are o_proj, down_proj, qkv_proj, gate_up_proj."
            in refused.content)
    assert not TrainingJob.objects.exists()


def test_beta_shows_only_with_dpo_and_a_hidden_one_is_not_sent(as_user, people, tenant_a):
    dataset = ready(tenant_a.tenant)
    client = as_user(people.member)
    page = client.get(reverse("dashboard:job-new")).content.decode()
    beta_field = page[page.rindex("<div", 0, page.index('id="hp-beta"')):page.index('id="hp-beta"')]
    assert 'data-method-only="dpo"' in beta_field and " hidden" in beta_field
    assert ' hidden' not in page[page.rindex("<div", 0, page.index('id="hp-r"')):page.index('id="hp-r"')]
    created = client.post(reverse("dashboard:job-create"), {
        "training_file": str(dataset.pk), "adapter": "bot", "method": "supervised", "beta": "0.5"})
    assert created.status_code == 302, created.content
    hp = TrainingJob.objects.get().hyperparameters
    assert hp["method"] == "supervised" and hp["beta"] == 0.1  # the default, never the hidden field's 0.5


def job_page(client, job: TrainingJob) -> str:
    return client.get(reverse("dashboard:job", args=[job.pk])).content.decode()


def test_the_job_page_shows_the_pace_and_charts_validation_only_where_there_is_some(as_user, people, tenant_a):
    dataset = ready(tenant_a.tenant)
    client = as_user(people.member)
    job = TrainingJob.objects.create(tenant=tenant_a.tenant, dataset=dataset, adapter_name="bot", base_model="tiny",
                                     hyperparameters={"method": "supervised", "r": 8}, seed=1)
    assert 'id="job-waiting"' in job_page(client, job)
    TrainingJob.objects.filter(pk=job.pk).update(status=TrainingJob.Status.RUNNING, total_steps=36)
    page = job_page(client, job)
    assert "Preparing: loading the base model" in page and 'data-validated="0"' in page
    for step in (1, 2):
        TrainingEvent.objects.create(job=job, type=TrainingEvent.Type.METRICS, message=f"Step {step}", data={
            "step": step, "train_loss": 2.0, **({"tokens_per_second": 123.4} if step == 2 else {})})
    TrainingJob.objects.filter(pk=job.pk).update(step=2, estimated_finish=timezone.now() + timedelta(minutes=3,
                                                                                                    seconds=10))
    page = job_page(client, job)
    assert "Preparing" not in page and '>123 trained tokens/s</span>' in page
    assert ">about 3 min left</span>" in page
    TrainingJob.objects.filter(pk=job.pk).update(estimated_finish=timezone.now() + timedelta(seconds=20))
    assert ">under a minute left</span>" in job_page(client, job)
    TrainingJob.objects.filter(pk=job.pk).update(estimated_finish=timezone.now() + timedelta(hours=2, minutes=40))
    assert ">about 2.7 h left</span>" in job_page(client, job)
    TrainingJob.objects.filter(pk=job.pk).update(validation_fraction=0.2)
    assert 'data-validated="1"' in job_page(client, job)


def test_the_form_sizes_a_job_by_the_tenants_last_measured_pace(as_user, people, tenant_a):
    dataset = ready(tenant_a.tenant)
    client = as_user(people.member)
    assert 'data-tokens-per-second=""' in client.get(reverse("dashboard:job-new")).content.decode()
    job = TrainingJob.objects.create(tenant=tenant_a.tenant, dataset=dataset, adapter_name="bot", base_model="tiny",
                                     hyperparameters={}, seed=1)
    TrainingEvent.objects.create(job=job, type=TrainingEvent.Type.METRICS, message="Step 9",
                                 data={"step": 9, "train_loss": 1.0, "tokens_per_second": 80.5})
    assert 'data-tokens-per-second="80.5"' in client.get(reverse("dashboard:job-new")).content.decode()
