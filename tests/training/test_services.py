"""Running jobs in-process through the services: idempotent redelivery, leases, all-or-nothing finish."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
from celery.exceptions import SoftTimeLimitExceeded
from django.utils import timezone

from serving.registry.storage import get_storage
from serving.registry.models import AdapterVersion
from tenants.models import Tier
from training import concurrency, datasets, jobs, run, scratch, sweep
from training.models import Checkpoint, Dataset, TrainingJob
from training_support import chat_lines, jsonl

pytestmark = pytest.mark.django_db

SMALL = {"n_epochs": 2, "batch_size": 4, "learning_rate": 1e-2, "r": 4, "lora_alpha": 8, "lora_dropout": 0.0}


@pytest.fixture
def dataset(platform, tenant_a, settings) -> Dataset:
    settings.TRAINING_CHECKPOINT_EVERY_STEPS = 2
    created = datasets.dataset_create(tenant=tenant_a.tenant, source=jsonl(chat_lines(1)), filename="t.jsonl")
    return datasets.dataset_validate(dataset_id=created.pk)


def new_job(tenant_a, dataset: Dataset, **fields) -> TrainingJob:
    job = jobs.training_job_create(tenant=tenant_a.tenant, training_file=dataset.pk, adapter="support-bot",
                                       hyperparameters=SMALL, seed=1, **fields)
    concurrency.training_jobs_dispatch()
    return job


def artifact_manifests(tenant_slug: str) -> list[str]:
    return [key for key in get_storage().list(f"adapters/{tenant_slug}") if key.endswith("manifest.json")]


def test_a_redelivery_after_publishing_registers_the_same_artifact_once(tenant_a, dataset, one_thread):
    job = new_job(tenant_a, dataset)
    run.training_job_run(job_id=job.pk)
    job.refresh_from_db()
    assert job.status == TrainingJob.Status.SUCCEEDED and job.version == "1.0.0"
    digest = job.adapter_version.manifest_sha256

    # The worker died after publishing, before registering: the version row is gone, the artifact stays.
    job.adapter_version.delete()
    TrainingJob.objects.filter(pk=job.pk).update(status=TrainingJob.Status.RUNNING, lease_token="dead",
                                                 heartbeat_at=timezone.now() - timedelta(hours=1),
                                                 finished_at=None)
    run.training_job_run(job_id=job.pk)
    job.refresh_from_db()
    assert job.status == TrainingJob.Status.SUCCEEDED and job.attempts == 2
    assert job.adapter_version.manifest_sha256 == digest
    assert job.events.filter(message__contains="already published by an earlier attempt").exists()
    assert AdapterVersion.objects.count() == 1 and artifact_manifests("alice-co") == [
        "adapters/alice-co/support-bot/1.0.0/manifest.json"]

    claim = run.training_job_run(job_id=job.pk)
    assert claim.job is None and claim.reason == "the job has already succeeded"
    assert AdapterVersion.objects.count() == 1


def test_a_live_run_makes_a_redelivery_wait_for_its_lease(tenant_a, dataset):
    job = new_job(tenant_a, dataset)
    assert run.training_job_claim(job_id=job.pk).token
    second = run.training_job_claim(job_id=job.pk)
    assert second.job is None and 0 < second.retry_in <= 60 and second.reason == "another run holds the job"


def test_when_registration_fails_the_artifact_is_deleted(tenant_a, dataset, one_thread):
    job = new_job(tenant_a, dataset)
    Tier.objects.filter(pk=tenant_a.tenant.tier_id).update(max_adapters=0)
    run.training_job_run(job_id=job.pk)
    job.refresh_from_db()
    assert job.status == TrainingJob.Status.FAILED and job.error_code == "max_adapters_reached"
    assert job.error_message.startswith("The trained adapter could not be registered: Tenant 'alice-co' has 0 adapters")
    assert artifact_manifests("alice-co") == [] and not AdapterVersion.objects.exists()
    assert job.version == "" and job.checkpoints.exists()

    Tier.objects.filter(pk=tenant_a.tenant.tier_id).update(max_adapters=5)
    jobs.training_job_retry(job=job)
    concurrency.training_jobs_dispatch()
    run.training_job_run(job_id=job.pk)
    job.refresh_from_db()
    assert job.status == TrainingJob.Status.SUCCEEDED and job.adapter_version.version == "1.0.0"
    assert job.events.filter(message="Resuming from the checkpoint of step 2.").exists()


def test_versions_auto_increment_and_requested_ones_are_kept(tenant_a, dataset, one_thread):
    first = new_job(tenant_a, dataset)
    run.training_job_run(job_id=first.pk)
    second = new_job(tenant_a, dataset)
    run.training_job_run(job_id=second.pk)
    third = new_job(tenant_a, dataset, version="2.0.0-rc.1")
    run.training_job_run(job_id=third.pk)
    versions = sorted(AdapterVersion.objects.values_list("version", flat=True))
    assert versions == ["1.0.0", "1.0.1", "2.0.0-rc.1"]
    assert all(v.status == AdapterVersion.Status.READY for v in AdapterVersion.objects.all())


def test_cancelling_a_job_whose_worker_is_gone_ends_it_at_once(tenant_a, dataset):
    job = new_job(tenant_a, dataset)
    run.training_job_claim(job_id=job.pk)
    TrainingJob.objects.filter(pk=job.pk).update(heartbeat_at=timezone.now() - timedelta(hours=1))
    cancelled = jobs.training_job_cancel(job=job)
    assert cancelled.status == TrainingJob.Status.CANCELLED and not Checkpoint.objects.exists()
    assert run.training_job_run(job_id=job.pk).reason == "the job has already cancelled"


def test_the_sweep_starts_waiting_jobs_and_resends_lost_tasks(tenant_a, dataset):
    job = jobs.training_job_create(tenant=tenant_a.tenant, training_file=dataset.pk, adapter="support-bot")
    assert job.total_steps == 2 * 3  # 8 examples in batches of 4, 3 epochs by default
    assert sweep.training_jobs_sweep()["dispatched"] == [job.pk]
    assert sweep.training_jobs_sweep() == NOTHING

    TrainingJob.objects.filter(pk=job.pk).update(dispatched_at=timezone.now() - timedelta(days=1))
    Dataset.objects.filter(pk=dataset.pk).update(status=Dataset.Status.UPLOADED,
                                                 validation_queued_at=timezone.now() - timedelta(days=1))
    assert sweep.training_jobs_sweep() == {**NOTHING, "resent": [job.pk], "validations": [dataset.pk]}
    assert job.events.filter(level="warning", message__contains="its task was sent again").exists()


NOTHING = {"dispatched": [], "resent": [], "validations": [], "validations_timed_out": []}


def test_the_sweep_resends_a_running_job_two_leases_after_its_last_heartbeat(tenant_a, dataset, settings):
    """Not after the broker's visibility timeout (6 h): a killed worker's job is taken over in minutes."""
    settings.TRAINING_LEASE_SECONDS = 60
    job = new_job(tenant_a, dataset)
    run.training_job_claim(job_id=job.pk)
    TrainingJob.objects.filter(pk=job.pk).update(heartbeat_at=timezone.now() - timedelta(seconds=90),
                                                 dispatched_at=timezone.now() - timedelta(seconds=600))
    assert sweep.training_jobs_sweep() == NOTHING  # one lease and a half: the run may be slow

    TrainingJob.objects.filter(pk=job.pk).update(heartbeat_at=timezone.now() - timedelta(seconds=130))
    assert sweep.training_jobs_sweep() == {**NOTHING, "resent": [job.pk]}
    assert sweep.training_jobs_sweep() == NOTHING  # the resent task gets two leases to start
    claim = run.training_job_claim(job_id=job.pk)
    assert claim.token and claim.job.attempts == 2


def test_the_sweep_sends_a_validation_never_sent_and_ends_one_stuck_past_its_timeout(tenant_a, platform, settings):
    settings.TRAINING_VALIDATION_TIMEOUT_SECONDS = 600
    unsent = datasets.dataset_create(tenant=tenant_a.tenant, source=jsonl(chat_lines(1)), filename="a.jsonl")
    assert unsent.validation_queued_at is None  # the test's transaction never commits: nothing was sent
    assert sweep.training_jobs_sweep() == NOTHING  # just uploaded: its task may still be on its way
    Dataset.objects.filter(pk=unsent.pk).update(created_at=timezone.now() - timedelta(seconds=61))
    assert sweep.training_jobs_sweep() == {**NOTHING, "validations": [unsent.pk]}

    stuck = datasets.dataset_create(tenant=tenant_a.tenant, source=jsonl(chat_lines(1)), filename="b.jsonl")
    Dataset.objects.filter(pk=stuck.pk).update(status=Dataset.Status.VALIDATING, validation_queued_at=timezone.now(),
                                               validation_started_at=timezone.now() - timedelta(seconds=599))
    assert sweep.training_jobs_sweep()["validations_timed_out"] == []
    Dataset.objects.filter(pk=stuck.pk).update(validation_started_at=timezone.now() - timedelta(seconds=601))
    assert sweep.training_jobs_sweep()["validations_timed_out"] == [stuck.pk]
    stuck.refresh_from_db()
    assert stuck.status == Dataset.Status.INVALID
    assert [error["code"] for error in stuck.report["errors"]] == ["validation_timeout"]
    assert "did not finish within 600 s" in stuck.report["errors"][0]["message"]
    # A late delivery of its task leaves the verdict alone.
    assert datasets.dataset_validate(dataset_id=stuck.pk).status == Dataset.Status.INVALID


def test_a_validation_past_its_time_budget_ends_the_dataset_invalid_with_a_line(tenant_a, platform, settings,
                                                                                monkeypatch):
    settings.TRAINING_VALIDATION_TIMEOUT_SECONDS = 0
    created = datasets.dataset_create(tenant=tenant_a.tenant, source=jsonl(chat_lines(1)), filename="a.jsonl")
    dataset = datasets.dataset_validate(dataset_id=created.pk)
    assert dataset.status == Dataset.Status.INVALID
    assert [(error["line"], error["code"]) for error in dataset.report["errors"]] == [(1, "validation_timeout")]
    assert "within its 0 s budget" in dataset.report["errors"][0]["message"]

    # A line that never came back: the task's soft time limit interrupts it, with the same verdict.
    def interrupted(*_, **__):
        raise SoftTimeLimitExceeded()

    settings.TRAINING_VALIDATION_TIMEOUT_SECONDS = 600
    monkeypatch.setattr(datasets, "validate_lines", interrupted)
    created = datasets.dataset_create(tenant=tenant_a.tenant, source=jsonl(chat_lines(1)), filename="b.jsonl")
    dataset = datasets.dataset_validate(dataset_id=created.pk)
    assert dataset.status == Dataset.Status.INVALID
    assert [error["code"] for error in dataset.report["errors"]] == ["validation_timeout"]
    assert "within its 600 s budget" in dataset.report["errors"][0]["message"]


def test_the_validation_task_is_bounded_past_the_budget():
    """The task's limits sit just past the budget (training.tasks), so a line that never returns
    frees its worker slot: soft, then hard."""
    from training import conf, tasks

    budget = conf.setting_int("TRAINING_VALIDATION_TIMEOUT_SECONDS")
    assert budget < tasks.dataset_validate.soft_time_limit < tasks.dataset_validate.time_limit <= budget + 300


def test_a_validation_that_crashes_ends_the_dataset_invalid_with_a_message(tenant_a, platform, settings, tmp_path,
                                                                          base_model_dir):
    broken = tmp_path / "broken-base"
    shutil.copytree(base_model_dir, broken)
    (broken / "tokenizer.json").write_text("{not json")
    settings.BASE_MODEL_PATH = broken
    created = datasets.dataset_create(tenant=tenant_a.tenant, source=jsonl(chat_lines(1)), filename="t.jsonl")
    dataset = datasets.dataset_validate(dataset_id=created.pk)
    assert dataset.status == Dataset.Status.INVALID and dataset.validation_started_at is not None
    [error] = dataset.report["errors"]
    assert error["code"] == "validation_failed" and "Validation stopped unexpectedly" in error["message"]


@pytest.mark.e2e
def test_scratch_folders_of_dead_runs_on_this_host_are_swept_and_live_ones_kept(settings, tmp_path):
    settings.TRAINING_SCRATCH_DIR = str(tmp_path / "scratch")
    mine = scratch.scratch_create(7)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host = socket.gethostname()
    orphan = tmp_path / "scratch" / f"job-8-{host}-{dead.pid}-x1"
    (orphan / "run").mkdir(parents=True)
    (orphan / "dataset-1.jsonl").write_text("tenant data")
    elsewhere = tmp_path / "scratch" / f"job-9-another-host-{dead.pid}-x2"
    elsewhere.mkdir()
    assert scratch.training_scratch_sweep() == [orphan]
    assert mine.is_dir() and elsewhere.is_dir() and not orphan.exists()


@pytest.mark.e2e
def test_a_killed_runs_zombie_does_not_keep_its_scratch_folder(settings, tmp_path):
    # A SIGKILLed worker's pool process is a zombie until it is reaped: its run is over all the same.
    settings.TRAINING_SCRATCH_DIR = str(tmp_path / "scratch")
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    while Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.01)  # exited, not reaped: Popen waits only when asked
    try:
        orphan = tmp_path / "scratch" / f"job-8-{socket.gethostname()}-{zombie.pid}-x1"
        orphan.mkdir(parents=True)
        assert scratch.training_scratch_sweep() == [orphan]
    finally:
        zombie.wait()


def test_a_validation_file_gives_the_valid_loss(tenant_a, dataset, one_thread):
    job = new_job(tenant_a, dataset, validation_file=dataset.pk)
    run.training_job_run(job_id=job.pk)
    job.refresh_from_db()
    assert job.status == TrainingJob.Status.SUCCEEDED and job.valid_loss is not None
    last = job.events.filter(type="metrics").order_by("-id").first()
    assert last.data["valid_loss"] == job.valid_loss and last.data["step"] == job.total_steps == 4
