"""Kept checkpoints as servable artifacts, in-process: what each one stores, what retention and a
cancel delete, and a version made from one (the service and the management API, two tenants).

Calling a checkpoint through the gateway and the OpenAI SDK's listing: test_checkpoint_models_e2e.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training.checkpoint_versions import checkpoint_version_create
from serving.contracts.artifact import adapter_digest, manifest_verify, sha256_file
from serving.registry.models import AdapterVersion, DeploymentEvent
from serving.registry.storage import get_storage
from serving.contracts.errors import Conflict, NotFound
from training import concurrency, datasets, jobs, run, selectors
from training.models import Checkpoint, Dataset, TrainingJob
from training_support import chat_lines, jsonl

pytestmark = pytest.mark.django_db

# 8 examples in batches of 4 for 4 epochs: 8 steps, a checkpoint every 2 before the last (2, 4, 6).
HYPERPARAMETERS = {"n_epochs": 4, "batch_size": 4, "learning_rate": 1e-2, "r": 4, "lora_alpha": 8,
                   "lora_dropout": 0.0}


@pytest.fixture
def dataset(platform, tenant_a, settings) -> Dataset:
    settings.TRAINING_CHECKPOINT_EVERY_STEPS = 2
    settings.TRAINING_CHECKPOINTS_KEPT = 2
    created = datasets.dataset_create(tenant=tenant_a.tenant, source=jsonl(chat_lines(1)), filename="t.jsonl")
    return datasets.dataset_validate(dataset_id=created.pk)


def trained(tenant_a, dataset: Dataset, **fields) -> TrainingJob:
    job = jobs.training_job_create(tenant=tenant_a.tenant, training_file=dataset.pk, adapter="ckpt-bot",
                                   hyperparameters=HYPERPARAMETERS, seed=3, **fields)
    concurrency.training_jobs_dispatch()
    run.training_job_run(job_id=job.pk)
    job.refresh_from_db()
    assert job.status == TrainingJob.Status.SUCCEEDED, job.error_message
    return job


def fetched(prefix: str, target: Path) -> Path:
    get_storage().download_prefix(prefix, target)
    return target


def test_each_kept_checkpoint_is_the_artifact_of_its_step_and_retention_deletes_the_older(
        tenant_a, dataset, one_thread, tmp_path):
    job = trained(tenant_a, dataset)
    # A job this short logs every step (training.pace), each point after the first with the pace.
    points = selectors.job_metrics(job=job)
    assert [point["step"] for point in points] == list(range(1, 9))
    assert "tokens_per_second" not in points[0] and all(point["tokens_per_second"] > 0 for point in points[1:])
    kept = list(Checkpoint.objects.filter(job=job).order_by("step"))
    assert [checkpoint.step for checkpoint in kept] == [4, 6]
    storage = get_storage()
    for checkpoint in kept:
        artifact = fetched(checkpoint.artifact_prefix, tmp_path / f"artifact-{checkpoint.step}")
        manifest = manifest_verify(artifact)
        # The row records where it is and what it is: the URI a worker loads and the manifest's digest.
        assert checkpoint.artifact_uri == storage.uri(checkpoint.artifact_prefix) + "/"
        assert checkpoint.manifest_sha256 == adapter_digest(artifact)
        assert manifest["adapter"] == {"tenant": "alice-co", "name": "ckpt-bot",
                                       "version": f"ftjob-{job.pk}:ckpt-step-{checkpoint.step}"}
        assert manifest["source"] == {"kind": "training_job", "id": str(job.pk)}
        assert sorted(manifest["files"]) == ["adapter_config.json", "adapter_model.safetensors"]
        # The same weights the run resumes from.
        state = fetched(checkpoint.storage_prefix, tmp_path / f"state-{checkpoint.step}")
        assert manifest["files"]["adapter_model.safetensors"]["sha256"] == sha256_file(
            state / "adapter_model.safetensors")
    assert kept[0].manifest_sha256 != kept[1].manifest_sha256
    # Step 2's state and artifact went with its row; nothing else is stored for the job.
    assert {key.split("/")[3] for key in storage.list(f"checkpoints/alice-co/{job.pk}")} == {
        "step-00000004", "step-00000004-adapter", "step-00000006", "step-00000006-adapter"}


def test_a_cancelled_jobs_checkpoint_artifacts_are_deleted(tenant_a, dataset, one_thread):
    job = trained(tenant_a, dataset)
    TrainingJob.objects.filter(pk=job.pk).update(status=TrainingJob.Status.RUNNING, finished_at=None)
    from training.base import checkpoints_delete

    checkpoints_delete(job.pk)  # what a cancel (or a run starting over) does
    assert not Checkpoint.objects.filter(job=job).exists()
    assert get_storage().list(f"checkpoints/alice-co/{job.pk}") == []


def test_a_cancellation_discards_the_rows_with_it_and_the_files_once_it_commits(
        tenant_a, dataset, one_thread, django_capture_on_commit_callbacks):
    from django.db import transaction

    from training.base import checkpoints_discard

    job = trained(tenant_a, dataset)
    prefix = f"checkpoints/alice-co/{job.pk}"
    stored = get_storage().list(prefix)
    assert stored and Checkpoint.objects.filter(job=job).count() == 2
    # Rolled back: rows and files both stay, and no deletion is left to run.
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        try:
            with transaction.atomic():
                checkpoints_discard(job.pk)
                assert not Checkpoint.objects.filter(job=job).exists()
                raise RuntimeError("the cancellation fails")
        except RuntimeError:
            pass
    assert callbacks == [] and Checkpoint.objects.filter(job=job).count() == 2
    assert get_storage().list(prefix) == stored
    # Committed: the rows are gone in the transaction, the files only after it.
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        with transaction.atomic():
            checkpoints_discard(job.pk)
            assert not Checkpoint.objects.filter(job=job).exists()
        assert get_storage().list(prefix) == stored
    assert len(callbacks) == 1 and get_storage().list(prefix) == []


def test_a_version_made_from_a_checkpoint_holds_its_weights_and_names_its_step(
        tenant_a, dataset, one_thread, tmp_path):
    job = trained(tenant_a, dataset)
    checkpoint = Checkpoint.objects.get(job=job, step=4)
    version = checkpoint_version_create(checkpoint=checkpoint, actor="user:alice", reason="step 4 was better")
    assert (version.version, version.status, version.source, version.source_id, version.source_checkpoint_step) == (
        "1.0.1", AdapterVersion.Status.READY, "training_job", str(job.pk), 4)
    assert version.base_model_revision == job.base_model_revision
    # The artifact's content: the checkpoint's files, byte for byte (digests), under a manifest naming the version.
    ours = manifest_verify(fetched(checkpoint.artifact_prefix, tmp_path / "checkpoint"))
    theirs_dir = fetched("adapters/alice-co/ckpt-bot/1.0.1", tmp_path / "version")
    theirs = manifest_verify(theirs_dir)
    assert theirs["files"] == ours["files"]
    assert theirs["adapter"] == {"tenant": "alice-co", "name": "ckpt-bot", "version": "1.0.1"}
    assert version.manifest_sha256 == adapter_digest(theirs_dir)
    assert version.artifact_uri == get_storage().uri("adapters/alice-co/ckpt-bot/1.0.1") + "/"
    event = DeploymentEvent.objects.filter(adapter=version.adapter, to_version="1.0.1").get()
    assert (event.kind, event.actor, event.reason) == ("register", "user:alice", "step 4 was better")

    # A taken version is refused by name, and nothing is published for it.
    with pytest.raises(Conflict) as refused:
        checkpoint_version_create(checkpoint=checkpoint, actor="user:alice", version="1.0.0")
    assert refused.value.code == "version_exists" and refused.value.param == "version"
    # A checkpoint retention took while the call was on its way is the checkpoint's 404.
    get_storage().delete_prefix(checkpoint.artifact_prefix)
    with pytest.raises(NotFound) as gone:
        checkpoint_version_create(checkpoint=checkpoint, actor="user:alice")
    assert gone.value.code == "checkpoint_not_found"
    assert [key for key in get_storage().list("adapters/alice-co/ckpt-bot") if key.endswith("manifest.json")] == [
        "adapters/alice-co/ckpt-bot/1.0.0/manifest.json", "adapters/alice-co/ckpt-bot/1.0.1/manifest.json"]


def test_the_management_api_makes_a_version_of_the_callers_checkpoint_only(
        tenant_a, dataset, one_thread, client_a, client_b):
    job = trained(tenant_a, dataset)
    listed = client_a.get(f"/api/v1/training-jobs/{job.pk}/checkpoints").json()["data"]
    assert [(item["step_number"], item["model"]) for item in listed] == [
        (6, f"ckpt-bot@ftjob-{job.pk}:ckpt-step-6"), (4, f"ckpt-bot@ftjob-{job.pk}:ckpt-step-4")]
    assert listed[0]["fine_tuned_model_checkpoint"] == f"ft:tiny-llama:alice-co:ckpt-bot:ftjob-{job.pk}:ckpt-step-6"

    url = f"/api/v1/training-jobs/{job.pk}/checkpoints/6/version"
    refused = client_b.post(url, {"version": "2.0.0"}, format="json")
    assert refused.status_code == 404 and refused.json()["error"]["code"] != "checkpoint_not_found"
    missing = client_a.post(f"/api/v1/training-jobs/{job.pk}/checkpoints/2/version", {}, format="json")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "checkpoint_not_found"
    invalid = client_a.post(url, {"version": "v2"}, format="json")
    assert invalid.status_code == 400 and invalid.json()["error"]["param"] == "version"

    created = client_a.post(url, {"version": "2.0.0", "reason": "best valid loss"}, format="json")
    assert created.status_code == 201, created.content
    body = created.json()
    assert (body["version"], body["model"], body["status"]) == ("2.0.0", "ckpt-bot@2.0.0", "ready")
    assert body["source"] == {"kind": "training_job", "id": str(job.pk), "checkpoint_step": 6}
    assert AdapterVersion.objects.filter(adapter__tenant=tenant_a.tenant).count() == 2
    assert json.loads(get_storage().get_bytes("adapters/alice-co/ckpt-bot/2.0.0/manifest.json"))["source"] == {
        "kind": "training_job", "id": str(job.pk)}
