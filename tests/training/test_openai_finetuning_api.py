"""OpenAI's files and fine-tuning API, driven by the official `openai` SDK against the Django app.

The SDK talks HTTP to the WSGI application in this process (httpx's WSGI transport), so every
request goes through URL routing, authentication, parsing and the error handler as it does under
uvicorn; test_openai_sdk_e2e.py runs the same SDK against a real web process and Celery worker.
As in test_api.py, validation runs through its service, since on-commit callbacks never fire in
these `db` tests.
"""

from __future__ import annotations

import httpx2
import openai
import pytest

from serving.registry.storage import get_storage
from tenants.services import api_key_create
from training import concurrency, datasets
from training.models import Checkpoint, Dataset, TrainingEvent, TrainingJob
from training_support import BASE_MODEL_NAME, chat_lines, error_of, jsonl, sdk

pytestmark = pytest.mark.django_db


def upload(client: openai.OpenAI, rows: list | bytes, name: str = "train.jsonl", *, validate: bool = True):
    data = rows if isinstance(rows, bytes) else jsonl(rows)
    created = client.files.create(file=(name, data), purpose="fine-tune")
    if validate:
        datasets.dataset_validate(dataset_id=int(created.id.removeprefix("file-")))
    return created


def test_file_upload_retrieve_content_list_delete(openai_a, django_capture_on_commit_callbacks):
    data = jsonl(chat_lines())
    created = openai_a.files.create(file=("train.jsonl", data), purpose="fine-tune")
    assert created.id.startswith("file-") and created.object == "file" and created.purpose == "fine-tune"
    assert (created.bytes, created.filename, created.status) == (len(data), "train.jsonl", "uploaded")
    assert created.status_details is None
    datasets.dataset_validate(dataset_id=int(created.id.removeprefix("file-")))

    fetched = openai_a.files.retrieve(created.id)
    assert fetched.status == "processed" and fetched.created_at == created.created_at
    assert openai_a.files.content(created.id).content == data
    assert [item.id for item in openai_a.files.list()] == [created.id]
    assert [item.id for item in openai_a.files.list(purpose="batch")] == []

    with django_capture_on_commit_callbacks(execute=True):
        deleted = openai_a.files.delete(created.id)
    assert (deleted.id, deleted.deleted) == (created.id, True)
    with pytest.raises(openai.NotFoundError) as raised:
        openai_a.files.retrieve(created.id)
    assert error_of(raised)["code"] == "file_not_found"
    assert get_storage().list("datasets") == []


def test_files_page_both_ways_through_their_cursor(openai_a):
    ids = [upload(openai_a, chat_lines(1), validate=False).id for _ in range(5)]
    assert [item.id for item in openai_a.files.list(limit=2)] == ids[::-1]
    page = openai_a.files.list(limit=2, order="asc")
    assert [item.id for item in page.data] == ids[:2] and page.has_more
    assert [item.id for item in openai_a.files.list(limit=2, order="asc", after=ids[2]).data] == ids[3:]
    for params, param in (({"after": "7"}, "after"), ({"limit": 0}, "limit"), ({"order": "up"}, "order")):
        with pytest.raises(openai.BadRequestError) as raised:
            openai_a.get("/files", cast_to=object, options={"params": params})
        assert error_of(raised)["param"] == param, params


def test_a_bad_file_is_an_error_with_its_lines_in_status_details(openai_a):
    rows = [*chat_lines(1)[:2], {"prompt_text": "x"}, {"messages": [{"role": "robot", "content": "hi"}]}]
    bad = upload(openai_a, jsonl(rows[:2]) + b'{"messages": "nope"}\n' + jsonl(rows[3:]))
    fetched = openai_a.files.retrieve(bad.id)
    assert fetched.status == "error"
    assert "line 3: missing_messages_list" in fetched.status_details
    assert "line 4: unrecognized_role" in fetched.status_details
    with pytest.raises(openai.BadRequestError) as raised:
        openai_a.fine_tuning.jobs.create(model=BASE_MODEL_NAME, training_file=bad.id)
    assert error_of(raised)["code"] == "dataset_invalid" and error_of(raised)["param"] == "training_file"


@pytest.mark.parametrize("purpose, code", [("batch", "invalid_purpose"), ("", "missing_purpose")])
def test_only_fine_tune_files_are_taken(openai_a, purpose, code):
    with pytest.raises(openai.BadRequestError) as raised:
        openai_a.files.create(file=("train.jsonl", jsonl(chat_lines(1))), purpose=purpose)
    assert error_of(raised)["code"] == code and error_of(raised)["param"] == "purpose"
    assert not Dataset.objects.exists() and get_storage().list("datasets") == []


def test_job_create_in_openai_shape_maps_onto_the_training_job(openai_a, tenant_a):
    training = upload(openai_a, chat_lines())
    validation = upload(openai_a, chat_lines(1), "valid.jsonl")
    job = openai_a.fine_tuning.jobs.create(
        model=BASE_MODEL_NAME, training_file=training.id, validation_file=validation.id, suffix="support-bot",
        seed=7, metadata={"team": "support"},
        hyperparameters={"n_epochs": 2, "batch_size": "auto", "learning_rate_multiplier": 2.5},
        extra_body={"hyperparameters": {"n_epochs": 2, "batch_size": "auto", "learning_rate_multiplier": 2.5,
                                        "r": 4, "target_modules": ["q_proj", "v_proj"]}},
    )
    assert job.id.startswith("ftjob-") and job.object == "fine_tuning.job" and job.status == "queued"
    assert (job.model, job.training_file, job.validation_file) == (BASE_MODEL_NAME, training.id, validation.id)
    assert (job.seed, job.metadata, job.organization_id) == (7, {"team": "support"}, "alice-co")
    assert job.fine_tuned_model is None and job.error is None and job.finished_at is None
    assert job.result_files == [] and job.trained_tokens is None
    assert (job.hyperparameters.n_epochs, job.hyperparameters.batch_size) == (2, 4)
    assert job.hyperparameters.learning_rate_multiplier == 2.5
    assert job.hyperparameters.r == 4 and job.hyperparameters.target_modules == ["q_proj", "v_proj"]
    assert job.method.type == "supervised" and job.method.supervised.hyperparameters.n_epochs == 2

    row = TrainingJob.objects.get(pk=int(job.id.removeprefix("ftjob-")))
    assert (row.adapter_name, row.seed, row.metadata) == ("support-bot", 7, {"team": "support"})
    assert row.hyperparameters["learning_rate"] == pytest.approx(5e-4) and row.hyperparameters["r"] == 4
    assert openai_a.fine_tuning.jobs.retrieve(job.id).model_dump() == job.model_dump()


def test_method_supervised_hyperparameters_and_a_generated_adapter_name(openai_a):
    training = upload(openai_a, chat_lines())
    job = openai_a.fine_tuning.jobs.create(
        model=BASE_MODEL_NAME, training_file=training.id,
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1, "use_dora": True}}})
    assert job.hyperparameters.n_epochs == 1 and job.hyperparameters.learning_rate_multiplier == 1
    assert job.user_provided_suffix.startswith("ft-")
    # The adapter kind, a Loraplex extension among the method's hyperparameters (docs/adapter-kinds.md).
    assert job.hyperparameters.use_dora is True
    assert TrainingJob.objects.get(pk=int(job.id.removeprefix("ftjob-"))).hyperparameters["use_dora"] is True


@pytest.mark.parametrize("fields, status, param, code", [
    ({"hyperparameters": {"n_epochs": 1, "warmup": 0.1}}, 400, "hyperparameters.warmup", "unknown_hyperparameter"),
    ({"hyperparameters": {"learning_rate_multiplier": 0}}, 400, "hyperparameters.learning_rate_multiplier",
     "hyperparameter_out_of_range"),
    ({"hyperparameters": {"learning_rate_multiplier": 2, "learning_rate": 1e-3}}, 400,
     "hyperparameters.learning_rate_multiplier", "invalid_hyperparameter"),
    ({"hyperparameters": {"r": 4096}}, 400, "hyperparameters.r", "hyperparameter_out_of_range"),
    ({"model": "gpt-4o-mini"}, 400, "model", "model_not_available"),
    ({"suffix": "Not A Name"}, 400, "suffix", "invalid_adapter_name"),
    ({"method": {"type": "reinforcement", "reinforcement": {}}}, 400, "method.type", "unsupported_method"),
    # DPO trains on a preference file, not this chat file (tests/training/test_dpo.py).
    ({"method": {"type": "dpo", "dpo": {}}}, 400, "training_file", "dataset_format_mismatch"),
    ({"method": {"type": "supervised", "supervised": {"hyperparameters": {"beta": 0.1}}}}, 400,
     "hyperparameters.beta", "invalid_hyperparameter"),
    ({"training_file": "file-999999"}, 404, "training_file", "file_not_found"),
    ({"training_file": "ds-1"}, 404, "training_file", "file_not_found"),
    ({"validation_file": 7}, 404, "validation_file", "file_not_found"),
    ({"metadata": {"k": 1}}, 400, "metadata.k", "invalid_request"),
    ({"seed": -1}, 400, "seed", "invalid_request"),
    ({"learning_rate": 0.1}, 400, "learning_rate", "unknown_parameter"),
])
def test_bad_job_requests_name_the_field_and_create_nothing(openai_a, fields, status, param, code):
    training = upload(openai_a, chat_lines())
    body = {"model": BASE_MODEL_NAME, "training_file": training.id, **fields}
    with pytest.raises(openai.APIStatusError) as raised:
        openai_a.post("/fine_tuning/jobs", body=body, cast_to=object)
    assert raised.value.status_code == status
    assert (error_of(raised)["param"], error_of(raised)["code"]) == (param, code), error_of(raised)
    assert not TrainingJob.objects.exists()


def test_a_job_waits_in_validating_files_then_queues_or_fails(openai_a):
    good = upload(openai_a, chat_lines(), validate=False)
    waiting = openai_a.fine_tuning.jobs.create(model=BASE_MODEL_NAME, training_file=good.id, suffix="bot")
    assert waiting.status == "validating_files"
    assert concurrency.training_jobs_dispatch() == []
    datasets.dataset_validate(dataset_id=int(good.id.removeprefix("file-")))
    queued = openai_a.fine_tuning.jobs.retrieve(waiting.id)
    assert queued.status == "queued"
    assert TrainingJob.objects.get(pk=int(waiting.id.removeprefix("ftjob-"))).total_steps == 12

    bad = upload(openai_a, b'{"messages": [{"role": "user", "content": "no reply"}]}\n', validate=False)
    doomed = openai_a.fine_tuning.jobs.create(model=BASE_MODEL_NAME, training_file=bad.id, suffix="bot")
    datasets.dataset_validate(dataset_id=int(bad.id.removeprefix("file-")))
    failed = openai_a.fine_tuning.jobs.retrieve(doomed.id)
    assert failed.status == "failed" and failed.finished_at is not None
    assert (failed.error.code, failed.error.param) == ("invalid_training_file", "training_file")
    assert "line 1" in failed.error.message and "assistant" in failed.error.message


def test_a_redelivered_validation_settles_a_waiting_job_once(openai_a):
    data = upload(openai_a, chat_lines(), validate=False)
    job = openai_a.fine_tuning.jobs.create(model=BASE_MODEL_NAME, training_file=data.id, suffix="bot")
    dataset_id = int(data.id.removeprefix("file-"))
    # A delivery that recorded the report and died before settling the job...
    report = datasets.dataset_validate(dataset_id=dataset_id).report
    row = TrainingJob.objects.get(pk=int(job.id.removeprefix("ftjob-")))
    TrainingJob.objects.filter(pk=row.pk).update(total_steps=None)
    row.events.filter(message__startswith="Files validated").delete()
    # ...and the redelivery, twice over.
    for _ in range(2):
        assert datasets.dataset_validate(dataset_id=dataset_id).report == report
    row.refresh_from_db()
    assert row.total_steps == 12 and row.status == "queued"
    assert row.events.filter(message__startswith="Files validated").count() == 1


@pytest.mark.slow
def test_pagination_walks_25_jobs_ten_at_a_time_each_once(openai_a, settings):
    settings.TRAINING_MAX_WAITING_JOBS = 30
    training = upload(openai_a, chat_lines(1))
    created = [openai_a.fine_tuning.jobs.create(model=BASE_MODEL_NAME, training_file=training.id,
                                                suffix="paged").id for _ in range(25)]
    first = openai_a.fine_tuning.jobs.list(limit=10)
    assert [job.id for job in first.data] == created[::-1][:10] and first.has_more
    pages, page = [first], first
    while page.has_next_page():
        page = page.get_next_page()
        pages.append(page)
    assert [len(item.data) for item in pages] == [10, 10, 5] and not pages[-1].has_more
    walked = [job.id for item in pages for job in item.data]
    assert walked == created[::-1]
    assert [job.id for job in openai_a.fine_tuning.jobs.list(limit=10)] == walked  # the SDK's auto-paging
    raw = openai_a.get("/fine_tuning/jobs", cast_to=object, options={"params": {"limit": 10}})
    assert (raw["object"], raw["first_id"], raw["last_id"]) == ("list", created[-1], created[-10])


def test_cancel_a_queued_job_and_events_in_openai_shape(openai_a):
    training = upload(openai_a, chat_lines())
    job = openai_a.fine_tuning.jobs.create(model=BASE_MODEL_NAME, training_file=training.id, suffix="bot")
    cancelled = openai_a.fine_tuning.jobs.cancel(job.id)
    assert cancelled.status == "cancelled" and cancelled.finished_at is not None
    with pytest.raises(openai.ConflictError) as raised:
        openai_a.fine_tuning.jobs.cancel(job.id)
    assert error_of(raised)["code"] == "job_finished"
    row = TrainingJob.objects.get(pk=int(job.id.removeprefix("ftjob-")))
    TrainingEvent.objects.create(job=row, level="warning", message="Careful.")
    TrainingEvent.objects.create(job=row, type="metrics", message="Step 4/12: train loss 1.5",
                                 data={"step": 4, "train_loss": 1.5, "train_mean_token_accuracy": 0.4})
    events = list(openai_a.fine_tuning.jobs.list_events(job.id, limit=2))
    assert [event.message for event in events] == [
        "Step 4/12: train loss 1.5", "Careful.", "Job cancelled.", "Job created: adapter 'bot', 16 examples, "
                                                                   "3 epoch(s)."]
    assert all(event.id.startswith("ftevent-") and event.object == "fine_tuning.job.event" for event in events)
    assert (events[0].type, events[0].data["train_loss"], events[1].level) == ("metrics", 1.5, "warn")
    assert events[2].level == "info" and events[2].type == "message"


def test_a_succeeded_job_has_its_metrics_as_a_results_file(openai_a, openai_b):
    training = upload(openai_a, chat_lines())
    job = openai_a.fine_tuning.jobs.create(model=BASE_MODEL_NAME, training_file=training.id, suffix="bot")
    assert job.result_files == []
    row = TrainingJob.objects.get(pk=int(job.id.removeprefix("ftjob-")))
    results_id = f"file-results-{row.pk}"
    with pytest.raises(openai.NotFoundError):
        openai_a.files.retrieve(results_id)  # only a succeeded job has one
    for step, loss, valid in ((4, 2.0, None), (8, 1.5, 1.75), (4, 1.9, None)):  # step 4 again: a resumed run
        TrainingEvent.objects.create(job=row, type="metrics", message=f"Step {step}",
                                     data={"step": step, "train_loss": loss, "train_mean_token_accuracy": 0.5,
                                           **({"valid_loss": valid} if valid else {})})
    TrainingJob.objects.filter(pk=row.pk).update(status="succeeded", version="1.0.0", finished_at=row.created_at)

    assert openai_a.fine_tuning.jobs.retrieve(job.id).result_files == [results_id]
    content = openai_a.files.content(results_id).content
    assert content.decode().splitlines() == ["step,train_loss,train_accuracy,valid_loss,valid_mean_token_accuracy",
                                             "4,1.9,0.5,,", "8,1.5,0.5,1.75,"]
    info = openai_a.files.retrieve(results_id)
    assert (info.purpose, info.status, info.bytes, info.filename) == ("fine-tune-results", "processed",
                                                                      len(content), "step_metrics.csv")
    with pytest.raises(openai.BadRequestError) as raised:
        openai_a.files.delete(results_id)
    assert error_of(raised)["code"] == "results_file_not_deletable"
    with pytest.raises(openai.NotFoundError):
        openai_b.files.content(results_id)


def test_checkpoints_in_openai_shape(openai_a):
    training = upload(openai_a, chat_lines())
    job = openai_a.fine_tuning.jobs.create(model=BASE_MODEL_NAME, training_file=training.id, suffix="bot")
    row = TrainingJob.objects.get(pk=int(job.id.removeprefix("ftjob-")))
    for step in (4, 8):
        Checkpoint.objects.create(job=row, step=step, storage_prefix=f"checkpoints/x/{step}",
                                  metrics={"train_loss": 2.0 / step, "valid_loss": None})
    checkpoints = list(openai_a.fine_tuning.jobs.checkpoints.list(job.id, limit=1))
    assert [item.step_number for item in checkpoints] == [8, 4]
    # OpenAI's checkpoint model name, which the gateway serves (tests/gateway/test_checkpoint_models_e2e.py).
    assert checkpoints[0].fine_tuned_model_checkpoint == f"ft:{BASE_MODEL_NAME}:alice-co:bot:{job.id}:ckpt-step-8"
    assert checkpoints[0].fine_tuning_job_id == job.id and checkpoints[0].id.startswith("ftckpt-")
    assert checkpoints[0].metrics.step == 8 and checkpoints[0].metrics.train_loss == 0.25


def test_a_file_in_use_cannot_be_deleted(openai_a, wsgi_app, tenant_a):
    training = upload(openai_a, chat_lines())
    job = openai_a.fine_tuning.jobs.create(model=BASE_MODEL_NAME, training_file=training.id, suffix="bot")
    sent = []
    retrying = openai.OpenAI(api_key=tenant_a.key, base_url="http://testserver/v1", http_client=httpx2.Client(
        transport=httpx2.WSGITransport(app=wsgi_app), event_hooks={"request": [sent.append]}))
    with pytest.raises(openai.ConflictError) as raised:
        retrying.files.delete(training.id)
    assert error_of(raised)["code"] == "dataset_in_use"
    assert f"#{job.id.removeprefix('ftjob-')}" in error_of(raised)["message"]  # it names the job in the way
    assert raised.value.response.headers["x-should-retry"] == "false" and len(sent) == 1  # not retried
    assert openai_a.files.retrieve(training.id).status == "processed"


def test_tenant_b_sees_none_of_tenant_a_files_or_jobs(openai_a, openai_b):
    training = upload(openai_a, chat_lines())
    job = openai_a.fine_tuning.jobs.create(model=BASE_MODEL_NAME, training_file=training.id, suffix="bot")
    assert list(openai_b.files.list()) == [] and list(openai_b.fine_tuning.jobs.list()) == []

    def missing(call, *args) -> dict:
        with pytest.raises(openai.NotFoundError) as raised:
            call(*args)
        return error_of(raised)

    never = f"file-{int(training.id.removeprefix('file-')) + 1000}"
    for call in (openai_b.files.retrieve, openai_b.files.content, openai_b.files.delete):
        assert missing(call, training.id) == {**missing(call, never),
                                              "message": f"No such File object: {training.id!r}."}
    never_job = f"ftjob-{int(job.id.removeprefix('ftjob-')) + 1000}"
    for call in (openai_b.fine_tuning.jobs.retrieve, openai_b.fine_tuning.jobs.cancel,
                 openai_b.fine_tuning.jobs.list_events, openai_b.fine_tuning.jobs.checkpoints.list):
        assert missing(call, job.id) == {**missing(call, never_job),
                                         "message": f"No such fine-tuning job: {job.id!r}."}
    with pytest.raises(openai.NotFoundError):
        openai_b.fine_tuning.jobs.create(model=BASE_MODEL_NAME, training_file=training.id)
    assert openai_a.fine_tuning.jobs.retrieve(job.id).status == "queued"
    assert openai_a.files.retrieve(training.id).status == "processed"


def test_keys_are_the_management_apis(platform, wsgi_app, tenant_a):
    with pytest.raises(openai.AuthenticationError) as raised:
        sdk(wsgi_app, "lp-nothing.wrong").files.list()
    assert error_of(raised)["code"] == "invalid_api_key"
    _, inference_only = api_key_create(tenant=tenant_a.tenant, name="chat", scopes=["inference"])
    with pytest.raises(openai.PermissionDeniedError) as raised:
        sdk(wsgi_app, inference_only).fine_tuning.jobs.list()
    assert "manage" in error_of(raised)["message"]


def test_the_schema_documents_the_openai_routes(client_a):
    paths = {path.rstrip("/") for path in client_a.get("/api/schema/", HTTP_ACCEPT="application/json").json()["paths"]}
    assert {"/v1/files", "/v1/files/{file_id}", "/v1/files/{file_id}/content", "/v1/fine_tuning/jobs",
            "/v1/fine_tuning/jobs/{job_id}", "/v1/fine_tuning/jobs/{job_id}/cancel",
            "/v1/fine_tuning/jobs/{job_id}/events", "/v1/fine_tuning/jobs/{job_id}/checkpoints",
            "/v1/fine_tuning/jobs/{job_id}/pause", "/v1/fine_tuning/jobs/{job_id}/resume", "/v1/uploads",
            "/v1/uploads/{upload_id}/parts", "/v1/uploads/{upload_id}/complete", "/v1/uploads/{upload_id}/cancel"} <= paths
