"""A clean stop of a real Celery worker mid-job (SIGTERM to its main process, as `make up`'s Ctrl-C and
`docker stop` send it): the run saves a checkpoint of the step it reached, releases the job's lease
and sends its task again; the job says it was interrupted; the next worker resumes it at once.

The lease here is 600 s and no periodic checkpoint falls within the run, so a resumption within the
test's wait can only come from the released lease and the re-sent task, from the checkpoint the
stop saved; the seconds from the second worker's start to the resumption are printed."""

from __future__ import annotations

import signal
import subprocess
import time

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.utils import timezone

from training.models import Checkpoint, TrainingEvent, TrainingJob

from training_support import chat_lines, jsonl, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

LEASE_SECONDS = 600
# Well below the lease: a job that waited for the lease to expire would fail the test.
RESUME_WAIT_S = 120


def upload_ready_dataset(client) -> int:
    response = client.post("/api/v1/datasets", {"file": SimpleUploadedFile("train.jsonl", jsonl(chat_lines(2)))},
                           format="multipart")
    assert response.status_code == 201, response.json()
    dataset_id = response.json()["id"]
    wait_for(lambda: client.get(f"/api/v1/datasets/{dataset_id}").json()["status"] == "ready", 60, "validation")
    return dataset_id


def test_a_clean_stop_checkpoints_the_job_releases_it_and_the_next_worker_resumes_it_at_once(
        platform, client_a, start_worker) -> None:
    env = {"TRAINING_LEASE_SECONDS": LEASE_SECONDS, "TRAINING_CHECKPOINT_EVERY_STEPS": 100_000,
           "TRAINING_LOG_EVERY_STEPS": 1}
    first = start_worker(**env)
    dataset_id = upload_ready_dataset(client_a)
    # 16 examples in batches of 2: 8 steps an epoch, 40 in all; the stop, asked once step 3 is seen,
    # lands before the next step (training.worker_stop), tens of steps before the end.
    job_id = client_a.post("/api/v1/training-jobs", {
        "training_file": dataset_id, "adapter": "interrupted", "seed": 5,
        "hyperparameters": {"n_epochs": 5, "batch_size": 2, "learning_rate": 1e-2, "lora_dropout": 0.0},
    }, format="json").json()["id"]
    # A metrics event a step (the job's own progress is saved once a second, tens of steps late).
    wait_for(lambda: TrainingEvent.objects.filter(job_id=job_id, type=TrainingEvent.Type.METRICS,
                                                  data__step__gte=3).exists(), 120, "the job to train", poll=0.05)

    first.process.send_signal(signal.SIGTERM)  # the main process only: it tells its pool process
    try:
        assert first.process.wait(timeout=60) == 0, first.output()[-3000:]
    except subprocess.TimeoutExpired:
        pytest.fail(f"the worker did not stop within 60 s:\n{first.output()[-3000:]}")

    job = TrainingJob.objects.get(pk=job_id)
    assert job.status == TrainingJob.Status.RUNNING and job.lease_token == "" and job.interrupted_at is not None
    [checkpoint] = Checkpoint.objects.filter(job=job)  # the one the stop saved: no periodic one fell due
    print(f"stopped at step {checkpoint.step} of {job.total_steps}")
    stopped = job.events.get(message__startswith="The worker stopped at step")
    assert stopped.data == {"step": checkpoint.step} and checkpoint.step >= 3
    body = client_a.get(f"/api/v1/training-jobs/{job_id}").json()
    assert body["status"] == "running"
    assert body["interrupted"] == {"at": body["interrupted"]["at"], "resumes_from_step": checkpoint.step}

    start_worker(**env)
    started, ready_at = time.monotonic(), timezone.now()
    resumed = wait_for(lambda: job.events.filter(message=f"Resuming from the checkpoint of step {checkpoint.step}.")
                       .first(), RESUME_WAIT_S, "the next worker to resume the job", poll=0.05)
    taken = job.events.get(message__startswith="A worker takes the job back after the clean stop")
    print(f"taken back {(taken.created_at - ready_at).total_seconds():.1f} s and resumed from the checkpoint "
          f"{(resumed.created_at - ready_at).total_seconds():.1f} s after the second worker was ready "
          f"(waited {time.monotonic() - started:.1f} s)")
    assert client_a.get(f"/api/v1/training-jobs/{job_id}").json()["interrupted"] is None

    final = wait_for(lambda: (lambda j: j if j.is_final else None)(TrainingJob.objects.get(pk=job_id)), 300,
                     "the job to finish", poll=0.5)
    assert final.status == TrainingJob.Status.SUCCEEDED and final.attempts == 2
    assert final.interrupted_at is None
    after = [event.data["step"] for event in final.events.filter(type=TrainingEvent.Type.METRICS, id__gt=resumed.id)
             .order_by("id")]
    assert after[0] == checkpoint.step + 1 and after[-1] == final.total_steps
