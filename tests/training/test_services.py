"""Running jobs in-process through the services: idempotent redelivery, leases, all-or-nothing finish."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from lora_platform.storage import get_storage
from serving.models import AdapterVersion
from tenants.models import Tier
from training import services
from training.models import Checkpoint, Dataset, TrainingJob
from training_support import chat_lines, jsonl

pytestmark = pytest.mark.django_db

SMALL = {"n_epochs": 2, "batch_size": 4, "learning_rate": 1e-2, "r": 4, "lora_alpha": 8, "lora_dropout": 0.0}


@pytest.fixture
def dataset(platform, tenant_a, settings) -> Dataset:
    settings.TRAINING_CHECKPOINT_EVERY_STEPS = 2
    created = services.dataset_create(tenant=tenant_a.tenant, source=jsonl(chat_lines(1)), filename="t.jsonl")
    return services.dataset_validate(dataset_id=created.pk)


def new_job(tenant_a, dataset: Dataset, **fields) -> TrainingJob:
    job = services.training_job_create(tenant=tenant_a.tenant, training_file=dataset.pk, adapter="support-bot",
                                       hyperparameters=SMALL, seed=1, **fields)
    services.training_jobs_dispatch(tenant_id=tenant_a.tenant.pk)
    return job


def artifact_manifests(tenant_slug: str) -> list[str]:
    return [key for key in get_storage().list(f"adapters/{tenant_slug}") if key.endswith("manifest.json")]


def test_a_redelivery_after_publishing_registers_the_same_artifact_once(tenant_a, dataset, one_thread):
    job = new_job(tenant_a, dataset)
    services.training_job_run(job_id=job.pk)
    job.refresh_from_db()
    assert job.status == TrainingJob.Status.SUCCEEDED and job.version == "1.0.0"
    digest = job.adapter_version.manifest_sha256

    # The worker died after publishing, before registering: the version row is gone, the artifact stays.
    job.adapter_version.delete()
    TrainingJob.objects.filter(pk=job.pk).update(status=TrainingJob.Status.RUNNING, lease_token="dead",
                                                 heartbeat_at=timezone.now() - timedelta(hours=1),
                                                 finished_at=None)
    services.training_job_run(job_id=job.pk)
    job.refresh_from_db()
    assert job.status == TrainingJob.Status.SUCCEEDED and job.attempts == 2
    assert job.adapter_version.manifest_sha256 == digest
    assert job.events.filter(message__contains="already published by an earlier attempt").exists()
    assert AdapterVersion.objects.count() == 1 and artifact_manifests("alice-co") == [
        "adapters/alice-co/support-bot/1.0.0/manifest.json"]

    claim = services.training_job_run(job_id=job.pk)
    assert claim.job is None and claim.reason == "the job has already succeeded"
    assert AdapterVersion.objects.count() == 1


def test_a_live_run_makes_a_redelivery_wait_for_its_lease(tenant_a, dataset):
    job = new_job(tenant_a, dataset)
    assert services.training_job_claim(job_id=job.pk).token
    second = services.training_job_claim(job_id=job.pk)
    assert second.job is None and 0 < second.retry_in <= 60 and second.reason == "another run holds the job"


def test_when_registration_fails_the_artifact_is_deleted(tenant_a, dataset, one_thread):
    job = new_job(tenant_a, dataset)
    Tier.objects.filter(pk=tenant_a.tenant.tier_id).update(max_adapters=0)
    services.training_job_run(job_id=job.pk)
    job.refresh_from_db()
    assert job.status == TrainingJob.Status.FAILED and job.error_code == "max_adapters_reached"
    assert job.error_message.startswith("The trained adapter could not be registered: Tenant 'alice-co' has 0 adapters")
    assert artifact_manifests("alice-co") == [] and not AdapterVersion.objects.exists()
    assert job.version == "" and job.checkpoints.exists()

    Tier.objects.filter(pk=tenant_a.tenant.tier_id).update(max_adapters=5)
    services.training_job_retry(job=job)
    services.training_jobs_dispatch(tenant_id=tenant_a.tenant.pk)
    services.training_job_run(job_id=job.pk)
    job.refresh_from_db()
    assert job.status == TrainingJob.Status.SUCCEEDED and job.adapter_version.version == "1.0.0"
    assert job.events.filter(message="Resuming from the checkpoint of step 2.").exists()


def test_versions_auto_increment_and_requested_ones_are_kept(tenant_a, dataset, one_thread):
    first = new_job(tenant_a, dataset)
    services.training_job_run(job_id=first.pk)
    second = new_job(tenant_a, dataset)
    services.training_job_run(job_id=second.pk)
    third = new_job(tenant_a, dataset, version="2.0.0-rc.1")
    services.training_job_run(job_id=third.pk)
    versions = sorted(AdapterVersion.objects.values_list("version", flat=True))
    assert versions == ["1.0.0", "1.0.1", "2.0.0-rc.1"]
    assert all(v.status == AdapterVersion.Status.READY for v in AdapterVersion.objects.all())


def test_cancelling_a_job_whose_worker_is_gone_ends_it_at_once(tenant_a, dataset):
    job = new_job(tenant_a, dataset)
    services.training_job_claim(job_id=job.pk)
    TrainingJob.objects.filter(pk=job.pk).update(heartbeat_at=timezone.now() - timedelta(hours=1))
    cancelled = services.training_job_cancel(job=job)
    assert cancelled.status == TrainingJob.Status.CANCELLED and not Checkpoint.objects.exists()
    assert services.training_job_run(job_id=job.pk).reason == "the job has already cancelled"


def test_the_sweep_fills_free_slots_and_resends_lost_tasks(tenant_a, dataset):
    job = services.training_job_create(tenant=tenant_a.tenant, training_file=dataset.pk, adapter="support-bot")
    assert job.total_steps == 2 * 3  # 8 examples in batches of 4, 3 epochs by default
    assert services.training_jobs_sweep()["dispatched"] == [job.pk]
    assert services.training_jobs_sweep() == {"dispatched": [], "resent": [], "validations": []}

    TrainingJob.objects.filter(pk=job.pk).update(dispatched_at=timezone.now() - timedelta(days=1))
    Dataset.objects.filter(pk=dataset.pk).update(status=Dataset.Status.VALIDATING,
                                                 created_at=timezone.now() - timedelta(days=1))
    assert services.training_jobs_sweep() == {"dispatched": [], "resent": [job.pk], "validations": [dataset.pk]}
    assert job.events.filter(level="warning", message__contains="its task was sent again").exists()


def test_a_validation_file_gives_the_valid_loss(tenant_a, dataset, one_thread):
    job = new_job(tenant_a, dataset, validation_file=dataset.pk)
    services.training_job_run(job_id=job.pk)
    job.refresh_from_db()
    assert job.status == TrainingJob.Status.SUCCEEDED and job.valid_loss is not None
    last = job.events.filter(type="metrics").order_by("-id").first()
    assert last.data["valid_loss"] == job.valid_loss and last.data["step"] == job.total_steps == 4
