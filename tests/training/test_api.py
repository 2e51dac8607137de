"""The datasets and training-jobs API: shapes, bad inputs (each a clear error, nothing half-made), tenancy, limits.

Validation runs here through its service (the Celery task's body); test_worker.py runs it in a
real worker. In these `db` tests on-commit callbacks never fire, so no task reaches the broker.
"""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from serving.registry.storage import get_storage
from serving.registry.services import adapter_create
from tenants.services import tenant_create
from training import concurrency, datasets, jobs
from training.models import Dataset, TrainingEvent, TrainingJob
from training_support import chat_lines, jsonl

pytestmark = pytest.mark.django_db


def upload(client, data: bytes, name: str = "train.jsonl"):
    return client.post("/api/v1/datasets", {"file": SimpleUploadedFile(name, data)}, format="multipart")


def ready_dataset(client, rows: list | None = None) -> int:
    response = upload(client, jsonl(rows or chat_lines()))
    assert response.status_code == 201, response.json()
    datasets.dataset_validate(dataset_id=response.json()["id"])
    return response.json()["id"]


def create_job(client, dataset_id: int, **fields):
    body = {"training_file": dataset_id, "adapter": "support-bot", **fields}
    return client.post("/api/v1/training-jobs", body, format="json")


def stored_keys() -> list[str]:
    return get_storage().list("")


def test_upload_streams_to_storage_with_its_sha256_then_validates(platform, client_a):
    data = jsonl(chat_lines())
    response = upload(client_a, data)
    assert response.status_code == 201
    body = response.json()
    assert body["object"] == "dataset" and body["status"] == "uploaded" and body["filename"] == "train.jsonl"
    assert body["sha256"] == hashlib.sha256(data).hexdigest() and body["bytes"] == len(data)
    (key,) = stored_keys()
    assert key.startswith("datasets/alice-co/") and get_storage().get_bytes(key) == data

    datasets.dataset_validate(dataset_id=body["id"])
    detail = client_a.get(f"/api/v1/datasets/{body['id']}").json()
    assert detail["status"] == "ready" and detail["format"] == "chat" and detail["num_examples"] == 16
    stats = detail["report"]["stats"]
    assert stats["total_tokens"] > stats["trained_tokens"] > 0 and stats["truncated_examples"] == 0
    listed = client_a.get("/api/v1/datasets").json()
    assert listed["object"] == "list" and [item["id"] for item in listed["data"]] == [body["id"]]


@pytest.mark.parametrize(("data", "code", "line"), [
    (b"this is not json\n", "invalid_json", 1),
    (jsonl([{"question": "q", "answer": "a"}]), "unrecognized_format", 1),
    (jsonl(chat_lines(1)) + b'{"prompt": "x"}\n', "mixed_formats", 9),
    (b"\n\n", "empty_file", None),
    (jsonl([{"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]}]),
     "unrecognized_role", 1),
    (jsonl(chat_lines(1)[:3] + [{"messages": [{"role": "user", "content": "hi"}]}]),
     "example_missing_assistant_message", 4),
])
def test_bad_files_are_invalid_with_line_numbers_and_cannot_train(platform, client_a, data, code, line):
    dataset_id = upload(client_a, data).json()["id"]
    datasets.dataset_validate(dataset_id=dataset_id)
    detail = client_a.get(f"/api/v1/datasets/{dataset_id}").json()
    assert detail["status"] == "invalid"
    assert (detail["report"]["errors"][0]["line"], detail["report"]["errors"][0]["code"]) == (line, code)

    response = create_job(client_a, dataset_id)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "dataset_invalid"
    assert f"GET /api/v1/datasets/{dataset_id}" in response.json()["error"]["message"]
    assert not TrainingJob.objects.exists()


def test_zero_byte_upload_is_refused_and_nothing_is_stored(platform, client_a):
    response = upload(client_a, b"")
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "empty_file" and "0 bytes" in response.json()["error"]["message"]
    assert not Dataset.objects.exists() and stored_keys() == []


def test_missing_file_field_is_named(platform, client_a):
    response = client_a.post("/api/v1/datasets", {"name": "x"}, format="multipart")
    assert response.status_code == 400 and response.json()["error"]["param"] == "file"


@pytest.mark.parametrize("limit_setting", [
    {"TRAINING_DATASET_MAX_BYTES": 300},
    {"TRAINING_DATASET_MAX_BYTES": 10_000_000, "TRAINING_DATASET_MAX_BYTES_BY_TIER": "vip=5000000,standard=300"},
])
def test_over_the_size_limit_is_413_and_nothing_is_kept(platform, settings, client_a, limit_setting):
    for name, value in limit_setting.items():
        setattr(settings, name, value)
    response = upload(client_a, jsonl(chat_lines()))
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["code"] == "dataset_too_large" and "300 bytes" in error["message"] and "'standard'" in error["message"]
    assert not Dataset.objects.exists() and stored_keys() == []
    assert upload(client_a, jsonl(chat_lines(1)[:1])).status_code == 201


def test_the_streaming_limit_holds_when_the_declared_size_lies(platform, settings, tenant_a):
    settings.TRAINING_DATASET_MAX_BYTES = 100
    with pytest.raises(Exception) as refused:
        datasets.dataset_create(tenant=tenant_a.tenant, source=SimpleUploadedFile("x.jsonl", b"x" * 500),
                                filename="x.jsonl", size=10)
    assert getattr(refused.value, "code", None) == "dataset_too_large"
    assert not Dataset.objects.exists() and stored_keys() == []


@pytest.mark.parametrize(("hyperparameters", "param", "code"), [
    ({"r": 1000}, "hyperparameters.r", "hyperparameter_out_of_range"),
    ({"n_epochs": 0}, "hyperparameters.n_epochs", "hyperparameter_out_of_range"),
    ({"learning_rate": 0}, "hyperparameters.learning_rate", "hyperparameter_out_of_range"),
    ({"lora_dropout": 0.9}, "hyperparameters.lora_dropout", "hyperparameter_out_of_range"),
    ({"max_seq_length": 100_000}, "hyperparameters.max_seq_length", "hyperparameter_out_of_range"),
    ({"batch_size": 2.5}, "hyperparameters.batch_size", "invalid_hyperparameter"),
    ({"target_modules": ["score"]}, "hyperparameters.target_modules", "unsupported_target_module"),
    ({"target_modules": ["q_proj", "lm_head"], "use_dora": True}, "hyperparameters.target_modules",
     "unsupported_target_module"),
    ({"lr": 0.1}, "hyperparameters.lr", "unknown_hyperparameter"),
])
def test_hyperparameters_out_of_range_are_refused(platform, client_a, hyperparameters, param, code):
    dataset_id = ready_dataset(client_a)
    response = create_job(client_a, dataset_id, hyperparameters=hyperparameters)
    assert response.status_code == 400, response.json()
    assert (response.json()["error"]["param"], response.json()["error"]["code"]) == (param, code)
    assert not TrainingJob.objects.exists()


def test_lora_on_the_vocabulary_modules_is_taken_where_the_engine_serves_it(platform, settings, client_a, tmp_path):
    """Issue 41, item 4: embed_tokens and lm_head may be named beside the projections (never by
    "all-linear"), but not on a base whose lm_head is its embed_tokens, which the engine refuses to
    serve such adapters on: refused before the job exists, the reason named."""
    dataset_id = ready_dataset(client_a)
    response = create_job(client_a, dataset_id, hyperparameters={"target_modules": ["lm_head", "q_proj", "embed_tokens"]})
    assert response.status_code == 201, response.json()
    assert response.json()["hyperparameters"]["target_modules"] == ["q_proj", "embed_tokens", "lm_head"]

    tied = tmp_path / "tied"
    shutil.copytree(settings.BASE_MODEL_PATH, tied)
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    settings.BASE_MODEL_PATH = tied
    response = create_job(client_a, dataset_id, hyperparameters={"target_modules": ["q_proj", "embed_tokens"]})
    assert response.status_code == 400, response.json()
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("unsupported_target_module", "hyperparameters.target_modules")
    assert "embed_tokens" in error["message"] and "tie_word_embeddings" in error["message"]
    assert TrainingJob.objects.count() == 1


def test_rank_limit_comes_from_the_platform_setting(platform, settings, client_a):
    settings.MAX_LORA_RANK = 4
    dataset_id = ready_dataset(client_a)
    response = create_job(client_a, dataset_id, hyperparameters={"r": 8})
    assert response.status_code == 400 and "at most 4" in response.json()["error"]["message"]


def test_job_defaults_are_resolved_and_shown_in_openai_like_shape(platform, client_a):
    dataset_id = ready_dataset(client_a)
    response = create_job(client_a, dataset_id, hyperparameters={"n_epochs": 2, "learning_rate": "auto"}, seed=5)
    assert response.status_code == 201
    job = response.json()
    assert job["object"] == "training_job" and job["status"] == "queued" and job["model"] == "tiny-llama"
    assert job["training_file"] == dataset_id and job["seed"] == 5 and job["fine_tuned_model"] is None
    assert job["hyperparameters"]["n_epochs"] == 2
    # "auto" on 16 examples: a small set's 10 × the default rate (training.hyperparameters.fit_to_dataset).
    assert job["hyperparameters"]["learning_rate"] == pytest.approx(2e-3)
    assert job["hyperparameters"]["target_modules"] == "all-linear" and job["error"] is None

    events = client_a.get(f"/api/v1/training-jobs/{job['id']}/events").json()
    assert events["object"] == "list" and events["data"][0]["object"] == "training_job.event"
    assert client_a.get(f"/api/v1/training-jobs/{job['id']}/checkpoints").json() == {
        "object": "list", "data": [], "has_more": False, "first_id": None, "last_id": None}


def test_another_tenants_dataset_and_jobs_do_not_exist(platform, client_a, client_b):
    dataset_id = ready_dataset(client_a)
    job_id = create_job(client_a, dataset_id).json()["id"]

    response = create_job(client_b, dataset_id, adapter="thief")
    assert response.status_code == 404 and response.json()["error"]["param"] == "training_file"
    for method, path in [("get", f"/api/v1/datasets/{dataset_id}"), ("delete", f"/api/v1/datasets/{dataset_id}"),
                         ("get", f"/api/v1/training-jobs/{job_id}"), ("post", f"/api/v1/training-jobs/{job_id}/cancel"),
                         ("get", f"/api/v1/training-jobs/{job_id}/events"),
                         ("get", f"/api/v1/training-jobs/{job_id}/checkpoints")]:
        assert getattr(client_b, method)(path).status_code == 404, path
    assert client_b.get("/api/v1/datasets").json()["data"] == []
    assert client_b.get("/api/v1/training-jobs").json()["data"] == []
    assert TrainingJob.objects.get(pk=job_id).status == TrainingJob.Status.QUEUED
    assert Dataset.objects.filter(pk=dataset_id).exists()


def test_concurrent_job_limit_queues_the_excess_and_refuses_beyond_the_waiting_room(platform, settings, api_client):
    settings.TRAINING_MAX_WAITING_JOBS = 1
    tenant, key = tenant_create(slug="small-co", tier_name="batch")  # one job at a time
    api_client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    dataset_id = ready_dataset(api_client)

    first = create_job(api_client, dataset_id).json()["id"]
    assert concurrency.training_jobs_dispatch() == [first]
    second = create_job(api_client, dataset_id, adapter="other-bot").json()["id"]
    assert concurrency.training_jobs_dispatch() == []

    refused = create_job(api_client, dataset_id, adapter="third-bot")
    assert refused.status_code == 403
    error = refused.json()["error"]
    assert error["code"] == "training_job_limit_reached" and "'batch' allows 1" in error["message"]
    assert TrainingJob.objects.count() == 2

    cancelled = api_client.post(f"/api/v1/training-jobs/{first}/cancel").json()
    assert cancelled["status"] == "cancelled"
    assert concurrency.training_jobs_dispatch() == [second]


def test_dataset_delete_is_refused_while_a_job_uses_it(platform, client_a, django_capture_on_commit_callbacks):
    dataset_id = ready_dataset(client_a)
    job_id = create_job(client_a, dataset_id).json()["id"]
    response = client_a.delete(f"/api/v1/datasets/{dataset_id}")
    assert response.status_code == 409 and f"#{job_id}" in response.json()["error"]["message"]
    assert len(stored_keys()) == 1

    assert client_a.post(f"/api/v1/training-jobs/{job_id}/cancel").json()["status"] == "cancelled"
    with django_capture_on_commit_callbacks(execute=True):
        response = client_a.delete(f"/api/v1/datasets/{dataset_id}")
    assert response.json() == {"id": dataset_id, "object": "dataset", "deleted": True}
    assert stored_keys() == [] and client_a.get(f"/api/v1/datasets/{dataset_id}").status_code == 404
    assert TrainingJob.objects.get(pk=job_id).dataset is None


def test_job_inputs_are_checked_before_anything_is_created(platform, client_a, tenant_a):
    dataset_id = ready_dataset(client_a)
    pending = upload(client_a, jsonl(chat_lines())).json()["id"]
    adapter_create(tenant=tenant_a.tenant, name="taken")
    from serving.registry.models import AdapterVersion

    AdapterVersion.objects.create(adapter=tenant_a.tenant.adapters.get(), version="1.0.0", artifact_uri="file:///x/",
                                  manifest_sha256="0" * 64, base_model="tiny-llama", rank=8, lora_alpha=16,
                                  size_bytes=1, source="upload")
    cases = [
        ({"training_file": pending}, 409, "dataset_not_ready"),
        ({"training_file": 999999}, 404, "dataset_not_found"),
        ({"adapter": "Not A Slug!"}, 400, "invalid_adapter_name"),
        ({"adapter": "tiny-llama"}, 400, "invalid_adapter_name"),
        ({"adapter": "taken", "version": "1.0.0"}, 409, "version_exists"),
        ({"version": "v1"}, 400, "invalid_version"),
        ({"validation_fraction": 0.9}, 400, "invalid_validation_fraction"),
        ({"validation_file": dataset_id, "validation_fraction": 0.1}, 400, "invalid_request"),
        ({"seed": -1}, 400, "invalid_request"),
    ]
    for fields, status_code, code in cases:
        response = create_job(client_a, fields.pop("training_file", dataset_id), **fields)
        assert (response.status_code, response.json()["error"]["code"]) == (status_code, code), (fields, response.json())
    assert not TrainingJob.objects.exists()


def test_cancel_and_retry(platform, client_a):
    dataset_id = ready_dataset(client_a)
    job_id = create_job(client_a, dataset_id).json()["id"]
    assert client_a.post(f"/api/v1/training-jobs/{job_id}/cancel").json()["status"] == "cancelled"
    again = client_a.post(f"/api/v1/training-jobs/{job_id}/cancel")
    assert again.status_code == 409 and again.json()["error"]["code"] == "job_finished"

    job = jobs.training_job_retry(job=TrainingJob.objects.get(pk=job_id))
    assert job.status == TrainingJob.Status.QUEUED and job.cancel_requested_at is None
    messages = [event.message for event in TrainingEvent.objects.filter(job=job).order_by("id")]
    assert messages[-2:] == ["Job cancelled.", "Job retried."]


def test_lists_page_newest_first(platform, client_a):
    ids = [upload(client_a, jsonl(chat_lines(1))).json()["id"] for _ in range(3)]
    first = client_a.get("/api/v1/datasets?limit=2").json()
    assert [item["id"] for item in first["data"]] == ids[::-1][:2] and first["has_more"]
    assert (first["object"], first["first_id"], first["last_id"]) == ("list", ids[2], ids[1])
    rest = client_a.get(f"/api/v1/datasets?limit=2&after={first['data'][-1]['id']}").json()
    assert [item["id"] for item in rest["data"]] == [ids[0]] and not rest["has_more"]
    assert client_a.get("/api/v1/datasets?limit=0").status_code == 400
    assert client_a.get("/api/v1/datasets?after=file-1").json()["error"]["param"] == "after"


def test_the_schema_documents_the_training_api(client_a):
    paths = json.loads(client_a.get("/api/schema/?format=json").content)["paths"]
    for path in ["/api/v1/datasets/", "/api/v1/datasets/{id}/", "/api/v1/training-jobs/",
                 "/api/v1/training-jobs/{id}/cancel/", "/api/v1/training-jobs/{id}/events/",
                 "/api/v1/training-jobs/{id}/checkpoints/"]:
        assert path in paths, path
    assert "multipart/form-data" in paths["/api/v1/datasets/"]["post"]["requestBody"]["content"]


def test_admin_lists_datasets_and_jobs_and_its_actions_call_the_services(platform, client_a, admin_client):
    dataset_id = ready_dataset(client_a)
    job_id = create_job(client_a, dataset_id).json()["id"]
    for path in ["/admin/training/dataset/", f"/admin/training/dataset/{dataset_id}/change/",
                 "/admin/training/trainingjob/", f"/admin/training/trainingjob/{job_id}/change/"]:
        assert admin_client.get(path).status_code == 200, path

    changelist = "/admin/training/trainingjob/"
    admin_client.post(changelist, {"action": "cancel_jobs", "_selected_action": [job_id]})
    assert TrainingJob.objects.get(pk=job_id).status == TrainingJob.Status.CANCELLED
    response = admin_client.post(changelist, {"action": "cancel_jobs", "_selected_action": [job_id]}, follow=True)
    assert "only queued, running or paused jobs can be cancelled" in response.content.decode()
    admin_client.post(changelist, {"action": "retry_jobs", "_selected_action": [job_id]})
    assert TrainingJob.objects.get(pk=job_id).status == TrainingJob.Status.QUEUED
