"""Pause and resume of a running job on a real Celery worker, through OpenAI's SDK (`jobs.pause`, `jobs.resume`).

The tenant may run one job at a time (the batch tier). Its running job is paused: the run saves a
checkpoint of the step it reached and stops, the job is `paused` and no longer holds the tenant's
place, so the tenant's next job starts and finishes meanwhile. Resumed, the job goes on from that
checkpoint and produces an adapter whose weights file is byte for byte the one an uninterrupted
job of the same file, hyperparameters and seed produces (the exact-resume contract of
test_trainer.py, here across a pause). A finished job cannot be paused.

The lease is 600 s and no periodic checkpoint falls within the run, so the checkpoint resumed from
can only be the one the pause saved.
"""

from __future__ import annotations

import openai
import pytest

from serving.registry.storage import get_storage
from tenants.models import Tier
from training.models import Checkpoint, TrainingEvent, TrainingJob
from training_support import BASE_MODEL_NAME, chat_lines, error_of, jsonl, sdk, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

ENV = {"TRAINING_LEASE_SECONDS": 600, "TRAINING_CHECKPOINT_EVERY_STEPS": 100_000, "TRAINING_LOG_EVERY_STEPS": 1}
# 16 examples, batch 2: 8 steps an epoch, 32 in all; dropout on, so the restored RNG state matters too.
# The pause is read before every step (training.run), so it lands a step or two after step 3 is seen,
# and the resumed run still crosses epochs.
HYPERPARAMETERS = {"n_epochs": 4, "batch_size": 2, "learning_rate_multiplier": 50, "lora_dropout": 0.1}
TOTAL_STEPS = 32


def row(job_id: str) -> TrainingJob:
    return TrainingJob.objects.get(pk=int(job_id.removeprefix("ftjob-")))


def wait_status(job_id: str, statuses: tuple[str, ...], timeout: float = 300) -> TrainingJob:
    return wait_for(lambda: (lambda job: job if job.status in statuses else None)(row(job_id)), timeout,
                    f"job {job_id} to be {' or '.join(statuses)}", poll=0.1)


def weights(adapter: str) -> bytes:
    return get_storage().get_bytes(f"adapters/alice-co/{adapter}/1.0.0/adapter_model.safetensors")


def test_a_paused_job_frees_its_place_and_resumes_to_the_adapter_of_an_uninterrupted_run(
        platform, wsgi_app, tenant_a, start_worker) -> None:
    tenant_a.tenant.tier = Tier.objects.get(name="batch")
    tenant_a.tenant.save(update_fields=["tier"])
    client = sdk(wsgi_app, tenant_a.key)
    start_worker(**ENV)
    file = client.files.create(file=("train.jsonl", jsonl(chat_lines(2))), purpose="fine-tune")
    wait_for(lambda: client.files.retrieve(file.id).status == "processed", 120, "validation")

    paused_job = client.fine_tuning.jobs.create(model=BASE_MODEL_NAME, training_file=file.id, suffix="paused-bot",
                                                seed=5, hyperparameters=HYPERPARAMETERS)
    other_job = client.fine_tuning.jobs.create(model=BASE_MODEL_NAME, training_file=file.id, suffix="other-bot",
                                               hyperparameters={"n_epochs": 1})
    # A metrics event a step (the job's own progress is saved once a second).
    wait_for(lambda: TrainingEvent.objects.filter(job=row(paused_job.id), type=TrainingEvent.Type.METRICS,
                                                  data__step__gte=3).exists(), 180, "the job to train", poll=0.05)
    assert row(other_job.id).status == "queued"  # one job at a time

    assert client.fine_tuning.jobs.pause(paused_job.id).status in ("running", "paused")
    paused = wait_status(paused_job.id, ("paused",), 60)
    [checkpoint] = Checkpoint.objects.filter(job=paused)  # the one the pause saved
    assert paused.lease_token == "" and paused.step == checkpoint.step >= 3
    print(f"paused at step {checkpoint.step} of {TOTAL_STEPS}")
    assert paused.events.get(message__startswith="Job paused").data == {"step": checkpoint.step}

    # Its place under the tenant's limit went to the next job, which runs to its end meanwhile.
    assert wait_status(other_job.id, ("succeeded", "failed"), 180).status == "succeeded"
    assert client.fine_tuning.jobs.retrieve(paused_job.id).status == "paused"

    # The answer reads the job after the resume's commit dispatched it: an idle worker may have
    # started it already (seen in a fresh-clone run).
    assert client.fine_tuning.jobs.resume(paused_job.id).status in ("queued", "running")
    final = wait_status(paused_job.id, ("succeeded", "failed", "cancelled"))
    assert final.status == "succeeded", final.error_message
    started = final.events.get(message=f"Resuming from the checkpoint of step {checkpoint.step}.")
    after = [event.data["step"] for event in final.events.filter(type=TrainingEvent.Type.METRICS, id__gt=started.id)
             .order_by("id")]
    assert after[0] == checkpoint.step + 1 and after[-1] == final.total_steps == TOTAL_STEPS

    straight = client.fine_tuning.jobs.create(model=BASE_MODEL_NAME, training_file=file.id, suffix="straight-bot",
                                              seed=5, hyperparameters=HYPERPARAMETERS)
    assert wait_status(straight.id, ("succeeded", "failed", "cancelled")).status == "succeeded"
    assert weights("paused-bot") == weights("straight-bot")

    with pytest.raises(openai.BadRequestError) as raised:
        client.fine_tuning.jobs.pause(paused_job.id)
    assert error_of(raised)["code"] == "job_not_pausable" and "has already succeeded" in error_of(raised)["message"]
