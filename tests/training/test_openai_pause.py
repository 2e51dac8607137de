"""Pausing and resuming fine-tuning jobs with OpenAI's SDK (`jobs.pause`, `jobs.resume`), in this process.

A waiting job pauses at once and frees its place under the tenant's concurrent-job limit; a
resumed one waits for room again; ended jobs are refused with a 400 naming their status; a paused
job keeps its file. The run's side (a running job checkpoints, pauses, and resumes to the same
adapter) is test_pause_resume.py's, on a real worker. Dispatch and validation run through their
services, since on-commit callbacks never fire in these `db` tests.
"""

from __future__ import annotations

import openai
import pytest

from tenants.models import Tier
from training import concurrency, datasets, run
from training.api import TrainingJobSerializer
from training.models import TrainingJob
from training_support import BASE_MODEL_NAME, chat_lines, error_of, jsonl

pytestmark = pytest.mark.django_db


@pytest.fixture
def one_at_a_time(tenant_a) -> None:
    """Tenant A on the batch tier: one job at a time."""
    tenant_a.tenant.tier = Tier.objects.get(name="batch")
    tenant_a.tenant.save(update_fields=["tier"])


def ready_file(client: openai.OpenAI, *, validate: bool = True) -> str:
    created = client.files.create(file=("train.jsonl", jsonl(chat_lines(1))), purpose="fine-tune")
    if validate:
        datasets.dataset_validate(dataset_id=int(created.id.removeprefix("file-")))
    return created.id


def row(job_id: str) -> TrainingJob:
    return TrainingJob.objects.get(pk=int(job_id.removeprefix("ftjob-")))


def holding(tenant) -> list[int]:
    counted = TrainingJob.objects.filter(concurrency.counts_toward_limit(), tenant=tenant)
    return list(counted.values_list("pk", flat=True))


def test_a_waiting_job_pauses_at_once_and_frees_its_place(openai_a, tenant_a, one_at_a_time):
    file_id = ready_file(openai_a)
    first = openai_a.fine_tuning.jobs.create(model=BASE_MODEL_NAME, training_file=file_id, suffix="first")
    second = openai_a.fine_tuning.jobs.create(model=BASE_MODEL_NAME, training_file=file_id, suffix="second")
    concurrency.training_jobs_dispatch()
    assert holding(tenant_a.tenant) == [row(first.id).pk]

    paused = openai_a.fine_tuning.jobs.pause(first.id)
    assert paused.status == "paused" and openai_a.fine_tuning.jobs.retrieve(first.id).status == "paused"
    assert row(first.id).dispatched_at is None
    concurrency.training_jobs_dispatch()
    assert holding(tenant_a.tenant) == [row(second.id).pk]  # the paused job's place went to the next one

    resumed = openai_a.fine_tuning.jobs.resume(first.id)
    assert resumed.status == "queued"
    concurrency.training_jobs_dispatch()
    assert holding(tenant_a.tenant) == [row(second.id).pk]  # it waits for room like any queued job
    messages = [event.message for event in openai_a.fine_tuning.jobs.list_events(first.id)]
    assert messages[0].startswith("Job resumed; it goes on from the start")
    assert messages[1].startswith("Job paused; it no longer counts toward the tenant's concurrent-job limit")


def test_pause_twice_is_one_pause_and_a_paused_job_is_claimed_by_no_run(openai_a, tenant_a):
    job = openai_a.fine_tuning.jobs.create(model=BASE_MODEL_NAME, training_file=ready_file(openai_a), suffix="bot")
    concurrency.training_jobs_dispatch()
    openai_a.fine_tuning.jobs.pause(job.id)
    assert openai_a.fine_tuning.jobs.pause(job.id).status == "paused"
    assert row(job.id).events.filter(message__startswith="Job paused").count() == 1
    # Its task was already sent: the delivery finds the job paused and leaves it.
    claim = run.training_job_run(job_id=row(job.id).pk)
    assert claim.job is None and claim.reason == "the job is paused" and row(job.id).status == "paused"


@pytest.mark.parametrize("ending", ["succeeded", "failed", "cancelled"])
def test_pause_of_an_ended_job_is_refused_naming_its_status(openai_a, ending):
    job = openai_a.fine_tuning.jobs.create(model=BASE_MODEL_NAME, training_file=ready_file(openai_a), suffix="bot")
    TrainingJob.objects.filter(pk=row(job.id).pk).update(status=ending)
    with pytest.raises(openai.BadRequestError) as raised:
        openai_a.fine_tuning.jobs.pause(job.id)
    assert error_of(raised)["code"] == "job_not_pausable" and f"has already {ending}" in error_of(raised)["message"]
    with pytest.raises(openai.BadRequestError) as raised:
        openai_a.fine_tuning.jobs.resume(job.id)
    assert error_of(raised)["code"] == "job_not_paused" and ending in error_of(raised)["message"]
    assert row(job.id).status == ending


def test_resume_of_a_job_that_is_not_paused_is_refused(openai_a):
    job = openai_a.fine_tuning.jobs.create(model=BASE_MODEL_NAME, training_file=ready_file(openai_a), suffix="bot")
    with pytest.raises(openai.BadRequestError) as raised:
        openai_a.fine_tuning.jobs.resume(job.id)
    assert error_of(raised)["code"] == "job_not_paused" and "is queued, not paused" in error_of(raised)["message"]


def test_a_running_job_is_asked_to_pause_and_a_run_that_finds_the_request_pauses_it(openai_a, tenant_a):
    job = openai_a.fine_tuning.jobs.create(model=BASE_MODEL_NAME, training_file=ready_file(openai_a), suffix="bot")
    concurrency.training_jobs_dispatch()
    assert run.training_job_claim(job_id=row(job.id).pk).token  # a live run holds the job
    assert openai_a.fine_tuning.jobs.pause(job.id).status == "running"  # it pauses before its next step
    assert row(job.id).pause_requested_at is not None
    assert TrainingJobSerializer(row(job.id)).data["pause_requested"] is True  # /api/v1's job says so

    # Resumed before the pause took effect: the request is withdrawn and the job goes on.
    assert openai_a.fine_tuning.jobs.resume(job.id).status == "running" and row(job.id).pause_requested_at is None
    openai_a.fine_tuning.jobs.pause(job.id)
    # That run stopped reporting before it could pause; the next delivery pauses the job.
    TrainingJob.objects.filter(pk=row(job.id).pk).update(heartbeat_at=row(job.id).heartbeat_at.replace(year=2000))
    claim = run.training_job_claim(job_id=row(job.id).pk)
    assert claim.job is None and claim.reason == "the job was paused"
    assert row(job.id).status == "paused" and row(job.id).lease_token == ""


def test_a_paused_job_keeps_its_file_and_can_be_cancelled(openai_a):
    file_id = ready_file(openai_a)
    job = openai_a.fine_tuning.jobs.create(model=BASE_MODEL_NAME, training_file=file_id, suffix="bot")
    openai_a.fine_tuning.jobs.pause(job.id)
    with pytest.raises(openai.ConflictError) as raised:
        openai_a.files.delete(file_id)
    assert error_of(raised)["code"] == "dataset_in_use"
    assert openai_a.fine_tuning.jobs.cancel(job.id).status == "cancelled"


def test_a_job_paused_while_its_file_was_validated_is_settled_on_resume(openai_a, tenant_a):
    file_id = ready_file(openai_a, validate=False)
    job = openai_a.fine_tuning.jobs.create(model=BASE_MODEL_NAME, training_file=file_id, suffix="bot",
                                           hyperparameters={"n_epochs": 2, "batch_size": 4})
    assert job.status == "validating_files"
    openai_a.fine_tuning.jobs.pause(job.id)
    datasets.dataset_validate(dataset_id=int(file_id.removeprefix("file-")))
    assert row(job.id).status == "paused" and row(job.id).total_steps is None
    assert openai_a.fine_tuning.jobs.resume(job.id).status == "queued"
    assert row(job.id).total_steps == 4  # 8 examples, batch 4, 2 epochs: planned as the release would have
