"""End to end on real parts: the REST API, a real Celery worker process, blob storage, the registry.

Upload a chat dataset → validated by the worker → training job → the worker trains the tiny model
→ the artifact is in storage (a local directory, or S3 on a moto server) → PEFT loads it → the loss
went down and the adapter really learned → the registry holds one `ready` version. Then the same
with the worker SIGKILLed mid-job: a new worker resumes from the checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from django.core.files.uploadedfile import SimpleUploadedFile
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from serving.registry.storage import get_storage
from serving.contracts.artifact import manifest_verify
from serving.registry.models import AdapterVersion
from training import sweep
from training.examples import Example, encode_example
from training.models import Checkpoint, TrainingEvent, TrainingJob
from training.trainer import token_nll

from training_support import QA, chat_lines, jsonl, wait_for

pytestmark = pytest.mark.django_db(transaction=True)

# Training completions must become at least this much likelier per token (nats) than under the base.
LEARNED_MARGIN = 0.3
LOSS_DROP = 0.3


def upload_ready_dataset(client, rows: list) -> int:
    response = client.post("/api/v1/datasets", {"file": SimpleUploadedFile("train.jsonl", jsonl(rows))},
                           format="multipart")
    assert response.status_code == 201, response.json()
    dataset_id = response.json()["id"]
    status = wait_for(lambda: (lambda s: s if s in ("ready", "invalid") else None)(
        client.get(f"/api/v1/datasets/{dataset_id}").json()["status"]), 60, "dataset validation")
    assert status == "ready", client.get(f"/api/v1/datasets/{dataset_id}").json()["report"]
    return dataset_id


def wait_job_final(client, job_id: int, timeout: float = 240) -> dict:
    def final() -> dict | None:
        body = client.get(f"/api/v1/training-jobs/{job_id}").json()
        return body if body["status"] in ("succeeded", "failed", "cancelled") else None

    return wait_for(final, timeout, f"training job {job_id}", poll=0.5)


def completion_nll(model: torch.nn.Module, tokenizer) -> float:
    examples = [encode_example(Example(format="chat", messages=(
        {"role": "system", "content": "Answer briefly.", "weight": 1},
        {"role": "user", "content": question, "weight": 1},
        {"role": "assistant", "content": answer, "weight": 1})), tokenizer) for question, answer in QA]
    return token_nll(model, examples, tokenizer.pad_token_id, torch.device("cpu"))


def check_artifact(job: TrainingJob, base_model_dir: Path, tmp_path: Path) -> None:
    """The artifact is published whole, its manifest verifies, PEFT loads it, and it learned."""
    version = job.adapter_version
    prefix = f"adapters/{job.tenant.slug}/{job.adapter_name}/{version.version}"
    storage = get_storage()
    assert sorted(key.rsplit("/", 1)[1] for key in storage.list(prefix)) == [
        "adapter_config.json", "adapter_model.safetensors", "manifest.json"]
    assert version.artifact_uri == storage.uri(prefix) + "/"
    local = tmp_path / "artifact"
    storage.download_prefix(prefix, local)
    manifest = manifest_verify(local)
    assert manifest["source"] == {"kind": "training_job", "id": str(job.pk)}
    assert manifest["adapter"] == {"tenant": job.tenant.slug, "name": job.adapter_name, "version": version.version}

    tokenizer = AutoTokenizer.from_pretrained(base_model_dir)
    base = AutoModelForCausalLM.from_pretrained(base_model_dir, dtype=torch.float32)
    base_nll = completion_nll(base, tokenizer)
    adapted = PeftModel.from_pretrained(base, local)
    adapted_nll = completion_nll(adapted, tokenizer)
    assert adapted_nll < base_nll - LEARNED_MARGIN, (base_nll, adapted_nll)


def metrics(job: TrainingJob) -> list[dict]:
    return [event.data for event in job.events.filter(type=TrainingEvent.Type.METRICS).order_by("id")]


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_dataset_to_ready_version_through_a_real_worker(backend, request, platform, settings, client_a, tenant_a,
                                                         start_worker, base_model_dir, tmp_path):
    if backend == "s3":
        bucket = request.getfixturevalue("s3_bucket")
        settings.STORAGE_URL = f"s3://{bucket}/loraplex"
        settings.S3_ENDPOINT_URL = request.getfixturevalue("moto_s3_endpoint")
    start_worker(TRAINING_CHECKPOINT_EVERY_STEPS=10, TRAINING_LOG_EVERY_STEPS=4)
    dataset_id = upload_ready_dataset(client_a, chat_lines(repeat=2))
    dataset = client_a.get(f"/api/v1/datasets/{dataset_id}").json()
    assert dataset["format"] == "chat" and dataset["num_examples"] == 16
    assert dataset["report"]["stats"]["total_tokens"] > 0

    response = client_a.post("/api/v1/training-jobs", {
        "training_file": dataset_id, "adapter": "support-bot", "validation_fraction": 0.125, "seed": 7,
        "hyperparameters": {"n_epochs": 10, "batch_size": 4, "learning_rate": 1e-2, "r": 8, "lora_alpha": 16,
                            "lora_dropout": 0.0},
    }, format="json")
    assert response.status_code == 201, response.json()
    body = wait_job_final(client_a, response.json()["id"])
    assert body["status"] == "succeeded", body
    assert body["fine_tuned_model"] == "support-bot@1.0.0"
    assert body["progress"]["step"] == body["progress"]["total_steps"] == 40

    job = TrainingJob.objects.select_related("adapter_version", "tenant").get(pk=body["id"])
    assert job.adapter_version.status == AdapterVersion.Status.READY
    assert job.adapter_version.source == AdapterVersion.Source.TRAINING_JOB
    assert AdapterVersion.objects.for_tenant(tenant_a.tenant).count() == 1
    losses = metrics(job)
    assert losses[0]["train_loss"] - losses[-1]["train_loss"] > LOSS_DROP, losses
    assert "valid_loss" in losses[-1]
    check_artifact(job, base_model_dir, tmp_path)
    assert Checkpoint.objects.filter(job=job).count() >= 1
    if backend == "local":
        cancel_while_running(client_a, dataset_id)


def cancel_while_running(client, dataset_id: int) -> None:
    """A running job stops at its next step on cancel, and leaves no artifact and no checkpoint."""
    job_id = client.post("/api/v1/training-jobs", {
        "training_file": dataset_id, "adapter": "support-bot", "hyperparameters": {"n_epochs": 50},
    }, format="json").json()["id"]
    wait_for(lambda: TrainingJob.objects.filter(pk=job_id, step__gte=1).exists(), 60, "the job to run", poll=0.1)
    response = client.post(f"/api/v1/training-jobs/{job_id}/cancel").json()
    assert response["status"] == "running" and response["cancel_requested"]
    body = wait_job_final(client, job_id)
    job = TrainingJob.objects.get(pk=job_id)
    assert body["status"] == "cancelled" and job.step < job.total_steps and job.version == ""
    # The rows go with the cancellation's commit, their files right after it (checkpoints_discard).
    assert not Checkpoint.objects.filter(job=job).exists()
    wait_for(lambda: get_storage().list(f"checkpoints/{job.tenant.slug}/{job.pk}") == [], 30, "the files to go")
    assert [key for key in get_storage().list("adapters") if key.endswith("manifest.json")] == [
        "adapters/alice-co/support-bot/1.0.0/manifest.json"]


def test_killed_worker_is_resumed_from_its_checkpoint(platform, client_a, tenant_a, start_worker, base_model_dir,
                                                      tmp_path):
    # Redis hands an unacknowledged task to another worker after the visibility timeout.
    env = {"CELERY_VISIBILITY_TIMEOUT": 3, "TRAINING_LEASE_SECONDS": 2, "TRAINING_CHECKPOINT_EVERY_STEPS": 10,
           "TRAINING_LOG_EVERY_STEPS": 1}
    # 16 examples in batches of 2: 8 steps an epoch, 40 in all, enough for the adapter to learn (the
    # artifact's check); killed after its step-10 checkpoint, 30 steps are still to go.
    first = start_worker(**env)
    dataset_id = upload_ready_dataset(client_a, chat_lines(repeat=2))
    response = client_a.post("/api/v1/training-jobs", {
        "training_file": dataset_id, "adapter": "resilient", "seed": 3,
        "hyperparameters": {"n_epochs": 5, "batch_size": 2, "learning_rate": 1e-2, "lora_dropout": 0.0},
    }, format="json")
    job_id = response.json()["id"]
    wait_for(lambda: Checkpoint.objects.filter(job_id=job_id).exists(), 120, "the first checkpoint", poll=0.05)
    first.kill()
    killed_at = TrainingJob.objects.get(pk=job_id)
    assert killed_at.status == TrainingJob.Status.RUNNING, "the job ended before the kill; make it longer"

    start_worker(**env)
    body = wait_job_final(client_a, job_id)
    assert body["status"] == "succeeded", body
    job = TrainingJob.objects.select_related("adapter_version", "tenant").get(pk=job_id)
    assert job.attempts == 2
    assert AdapterVersion.objects.for_tenant(tenant_a.tenant).count() == 1
    assert [key for key in get_storage().list(f"adapters/{job.tenant.slug}") if key.endswith("manifest.json")] == [
        f"adapters/{job.tenant.slug}/resilient/1.0.0/manifest.json"]

    resumed = job.events.filter(message__startswith="Resuming from the checkpoint of step").get()
    step = resumed.data["step"]
    assert step >= 10
    after = [event.data["step"] for event in job.events.filter(type=TrainingEvent.Type.METRICS, id__gt=resumed.id)
             .order_by("id")]
    assert after[0] == step + 1 and after[-1] == job.total_steps == 40
    check_artifact(job, base_model_dir, tmp_path)


def test_a_killed_workers_job_is_resent_by_the_sweep_and_its_scratch_folder_swept(
        platform, client_a, tenant_a, start_worker, settings, tmp_path):
    """Issue 16, item 3: with the broker's real visibility timeout (6 h), the sweep re-sends a job two
    leases after its worker died; the next worker removes the scratch folder (the tenant's dataset)
    the killed run left."""
    scratch = tmp_path / "scratch"
    settings.TRAINING_LEASE_SECONDS = 2
    env = {"TRAINING_LEASE_SECONDS": 2, "TRAINING_CHECKPOINT_EVERY_STEPS": 5, "TRAINING_SCRATCH_DIR": scratch}
    assert "CELERY_VISIBILITY_TIMEOUT" not in os.environ
    first = start_worker(**env)
    dataset_id = upload_ready_dataset(client_a, chat_lines(repeat=2))
    # 16 examples in batches of 2: 8 steps an epoch, 32 in all; killed after its step-5 checkpoint, 27
    # steps are still to go.
    response = client_a.post("/api/v1/training-jobs", {
        "training_file": dataset_id, "adapter": "swept", "seed": 3,
        "hyperparameters": {"n_epochs": 4, "batch_size": 2, "learning_rate": 1e-2, "lora_dropout": 0.0},
    }, format="json")
    job_id = response.json()["id"]
    wait_for(lambda: Checkpoint.objects.filter(job_id=job_id).exists(), 120, "the first checkpoint", poll=0.05)
    first.kill()
    assert TrainingJob.objects.get(pk=job_id).status == TrainingJob.Status.RUNNING
    [left] = list(scratch.iterdir())
    assert left.name.startswith(f"job-{job_id}-") and (left / f"dataset-{dataset_id}.jsonl").is_file()

    start_worker(**env)
    assert not left.exists()  # swept at the worker's start
    # The sweep (beat's, every minute) re-sends the job once its lease has been silent for two leases.
    wait_for(lambda: sweep.training_jobs_sweep()["resent"] == [job_id], 30, "the sweep to re-send the job")
    body = wait_job_final(client_a, job_id)
    assert body["status"] == "succeeded", body
    job = TrainingJob.objects.get(pk=job_id)
    assert job.attempts == 2 and job.events.filter(message__startswith="Resuming from the checkpoint").exists()
    assert AdapterVersion.objects.for_tenant(tenant_a.tenant).count() == 1
    # The finished run removes its own, in its `finally` after the job's end has committed (which the
    # test may read first).
    wait_for(lambda: list(scratch.iterdir()) == [], 30, "the finished run to remove its scratch folder")


def test_lines_that_used_to_crash_the_validation_task_are_line_errors_on_a_real_worker(
        platform, client_a, start_worker):
    """Issue 16, item 6: a line nested 100k deep and a lone surrogate no longer leave the dataset
    `validating` for ever; the worker reports them as line errors and stays up for the next file."""
    start_worker()
    deep = b"[" * 100_000 + b"]" * 100_000 + b"\n"
    surrogate = b'{"messages": [{"role": "user", "content": "Hi \\ud800"}, {"role": "assistant", "content": "Yo."}]}\n'
    body = jsonl(chat_lines(1)) + deep + surrogate
    response = client_a.post("/api/v1/datasets", {"file": SimpleUploadedFile("hostile.jsonl", body)}, format="multipart")
    assert response.status_code == 201, response.json()
    dataset_id = response.json()["id"]
    report = wait_for(lambda: (lambda d: d if d["status"] in ("ready", "invalid") else None)(
        client_a.get(f"/api/v1/datasets/{dataset_id}").json()), 120, "validation of the hostile file")
    assert report["status"] == "invalid"
    assert [(error["line"], error["code"]) for error in report["report"]["errors"]] == [
        (9, "json_too_deep"), (10, "invalid_unicode")]
    upload_ready_dataset(client_a, chat_lines(repeat=2))  # the same worker validates the next file
