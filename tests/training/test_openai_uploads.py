"""OpenAI's Uploads API (/v1/uploads) with the official `openai` SDK against the Django app in this process.

A file sent in three parts completes into a file that validates and trains; every refused
completion (a part whose stored bytes changed, a wrong total, a wrong md5) names what was wrong and
leaves no file and no stored dataset, the upload staying pending with its parts; a part whose
declared sha256 differs is not kept; cancel and expiry delete the parts; another tenant's upload is
a 404. As in test_openai_finetuning_api.py, validation and dispatch run through their services.
"""

from __future__ import annotations

import hashlib
from datetime import timedelta

import openai
import pytest
from django.utils import timezone

from serving.registry.storage import get_storage
from training import concurrency, datasets, run, uploads
from training.models import Dataset, TrainingJob, Upload, UploadPart
from training_support import BASE_MODEL_NAME, chat_lines, error_of, jsonl

pytestmark = pytest.mark.django_db

DATA = jsonl(chat_lines(1))
MIME = "application/jsonl"


def thirds(data: bytes) -> list[bytes]:
    cut = len(data) // 3
    return [data[:cut], data[cut:2 * cut], data[2 * cut:]]


def start(client: openai.OpenAI, data: bytes = DATA, name: str = "train.jsonl"):
    return client.uploads.create(filename=name, purpose="fine-tune", bytes=len(data), mime_type=MIME)


def send_parts(client: openai.OpenAI, upload_id: str, pieces: list[bytes]) -> list[str]:
    return [client.uploads.parts.create(upload_id, data=piece).id for piece in pieces]


def nothing_completed() -> bool:
    return not Dataset.objects.exists() and get_storage().list("datasets") == []


def stored_parts(upload_id: str) -> list[str]:
    return get_storage().list(f"uploads/alice-co/{upload_id.removeprefix('upload_')}")


def test_three_parts_complete_into_a_file_that_validates_and_trains(openai_a, settings, one_thread):
    settings.TRAINING_CHECKPOINT_EVERY_STEPS = 100
    upload = start(openai_a)
    assert (upload.object, upload.status, upload.bytes, upload.purpose) == ("upload", "pending", len(DATA), "fine-tune")
    assert upload.id.startswith("upload_") and upload.expires_at == upload.created_at + 3600 and upload.file is None
    part_ids = send_parts(openai_a, upload.id, thirds(DATA))
    part = UploadPart.objects.get(pk=int(part_ids[0].removeprefix("part_")))
    assert part.sha256 == hashlib.sha256(thirds(DATA)[0]).hexdigest() and part.size_bytes == len(thirds(DATA)[0])

    done = openai_a.uploads.complete(upload.id, part_ids=part_ids, md5=hashlib.md5(DATA).hexdigest())
    assert done.status == "completed" and done.file.id.startswith("file-") and done.file.bytes == len(DATA)
    assert done.file.filename == "train.jsonl" and done.file.status == "uploaded"
    assert openai_a.files.content(done.file.id).content == DATA
    dataset = Dataset.objects.get(pk=int(done.file.id.removeprefix("file-")))
    assert dataset.sha256 == hashlib.sha256(DATA).hexdigest()
    assert not UploadPart.objects.exists()

    # The same validation as a direct upload, then a job on it trains to a version.
    datasets.dataset_validate(dataset_id=dataset.pk)
    assert openai_a.files.retrieve(done.file.id).status == "processed"
    job = openai_a.fine_tuning.jobs.create(model=BASE_MODEL_NAME, training_file=done.file.id, suffix="parts-bot",
                                           hyperparameters={"n_epochs": 1, "batch_size": 4})
    concurrency.training_jobs_dispatch()
    run.training_job_run(job_id=int(job.id.removeprefix("ftjob-")))
    finished = openai_a.fine_tuning.jobs.retrieve(job.id)
    assert finished.status == "succeeded" and finished.fine_tuned_model == "parts-bot@1.0.0"


def test_the_parts_of_a_completed_upload_are_deleted_from_storage(openai_a, django_capture_on_commit_callbacks):
    upload = start(openai_a)
    part_ids = send_parts(openai_a, upload.id, thirds(DATA))
    assert len(stored_parts(upload.id)) == 3
    with django_capture_on_commit_callbacks(execute=True):
        openai_a.uploads.complete(upload.id, part_ids=part_ids)
    assert stored_parts(upload.id) == []


def test_a_completed_file_goes_through_the_same_validation(openai_a):
    bad = DATA + b'{"messages": "nope"}\n'
    upload = start(openai_a, bad)
    done = openai_a.uploads.complete(upload.id, part_ids=send_parts(openai_a, upload.id, thirds(bad)))
    datasets.dataset_validate(dataset_id=int(done.file.id.removeprefix("file-")))
    fetched = openai_a.files.retrieve(done.file.id)
    assert fetched.status == "error" and "line 9: missing_messages_list" in fetched.status_details


def test_a_part_whose_stored_bytes_changed_is_refused_and_nothing_is_left(openai_a):
    upload = start(openai_a)
    part_ids = send_parts(openai_a, upload.id, thirds(DATA))
    middle = UploadPart.objects.get(pk=int(part_ids[1].removeprefix("part_")))
    get_storage().put(middle.storage_key, b"X" * middle.size_bytes)  # same size, other bytes
    with pytest.raises(openai.BadRequestError) as raised:
        openai_a.uploads.complete(upload.id, part_ids=part_ids)
    error = error_of(raised)
    assert error["code"] == "part_digest_mismatch" and error["param"] == "part_ids"
    assert part_ids[1] in error["message"] and "number 2" in error["message"]
    assert nothing_completed()
    # The upload stays pending with its parts, until it is cancelled or expires.
    assert Upload.objects.get().status == "pending" and len(stored_parts(upload.id)) == 3


def test_a_part_sent_with_a_wrong_sha256_is_not_kept(openai_a):
    upload = start(openai_a)
    first = thirds(DATA)[0]
    with pytest.raises(openai.BadRequestError) as raised:
        openai_a.uploads.parts.create(upload.id, data=first, extra_body={"sha256": "0" * 64})
    error = error_of(raised)
    assert error["code"] == "part_digest_mismatch" and error["param"] == "sha256"
    assert hashlib.sha256(first).hexdigest() in error["message"]
    assert not UploadPart.objects.exists() and stored_parts(upload.id) == []
    kept = openai_a.uploads.parts.create(upload.id, data=first,
                                         extra_body={"sha256": hashlib.sha256(first).hexdigest()})
    assert kept.object == "upload.part" and kept.upload_id == upload.id and len(stored_parts(upload.id)) == 1


def test_a_wrong_total_is_refused_and_nothing_is_left(openai_a):
    upload = start(openai_a)
    pieces = thirds(DATA)
    part_ids = send_parts(openai_a, upload.id, pieces[:2])
    with pytest.raises(openai.BadRequestError) as raised:
        openai_a.uploads.complete(upload.id, part_ids=part_ids)
    error = error_of(raised)
    assert error["code"] == "upload_size_mismatch"
    assert f"hold {len(pieces[0]) + len(pieces[1])} bytes" in error["message"] and str(len(DATA)) in error["message"]
    assert nothing_completed()
    # A part past the declared total is refused as it arrives, and not kept.
    with pytest.raises(openai.BadRequestError) as raised:
        openai_a.uploads.parts.create(upload.id, data=pieces[2] + b"\n")
    assert error_of(raised)["code"] == "upload_bytes_exceeded" and len(stored_parts(upload.id)) == 2


def test_a_wrong_md5_is_refused_then_the_right_order_completes(openai_a):
    upload = start(openai_a)
    part_ids = send_parts(openai_a, upload.id, thirds(DATA))
    with pytest.raises(openai.BadRequestError) as raised:
        openai_a.uploads.complete(upload.id, part_ids=part_ids[::-1], md5=hashlib.md5(DATA).hexdigest())
    error = error_of(raised)
    assert error["code"] == "md5_mismatch" and error["param"] == "md5" and "order" in error["message"]
    assert nothing_completed()
    done = openai_a.uploads.complete(upload.id, part_ids=part_ids, md5=hashlib.md5(DATA).hexdigest())
    assert done.status == "completed" and openai_a.files.content(done.file.id).content == DATA


@pytest.mark.parametrize("part_ids, code", [([], None), (["part_1", "part_1"], None), (["file-3"], "part_not_found")])
def test_bad_part_lists_are_refused(openai_a, part_ids, code):
    upload = start(openai_a)
    send_parts(openai_a, upload.id, [DATA])
    with pytest.raises(openai.BadRequestError) as raised:
        openai_a.uploads.complete(upload.id, part_ids=part_ids)
    assert error_of(raised)["param"] == "part_ids" and (code is None or error_of(raised)["code"] == code)
    assert nothing_completed()


def test_cancel_deletes_the_parts_and_ends_the_upload(openai_a, django_capture_on_commit_callbacks):
    upload = start(openai_a)
    part_ids = send_parts(openai_a, upload.id, thirds(DATA)[:2])
    with django_capture_on_commit_callbacks(execute=True):
        cancelled = openai_a.uploads.cancel(upload.id)
    assert cancelled.status == "cancelled" and cancelled.file is None
    assert stored_parts(upload.id) == [] and not UploadPart.objects.exists()
    for call in (lambda: openai_a.uploads.complete(upload.id, part_ids=part_ids),
                 lambda: openai_a.uploads.parts.create(upload.id, data=b"more"),
                 lambda: openai_a.uploads.cancel(upload.id)):
        with pytest.raises(openai.BadRequestError) as raised:
            call()
        assert error_of(raised)["code"] == "upload_cancelled" and "cancelled" in error_of(raised)["message"]
    assert nothing_completed()


def test_an_upload_expires_after_an_hour(openai_a, django_capture_on_commit_callbacks):
    upload = start(openai_a)
    send_parts(openai_a, upload.id, thirds(DATA)[:1])
    Upload.objects.update(expires_at=timezone.now() - timedelta(seconds=1))
    with pytest.raises(openai.BadRequestError) as raised:
        openai_a.uploads.parts.create(upload.id, data=b"late")
    assert error_of(raised)["code"] == "upload_expired"
    with django_capture_on_commit_callbacks(execute=True):
        assert uploads.uploads_expire() == [int(upload.id.removeprefix("upload_"))]
    assert Upload.objects.get().status == "expired" and stored_parts(upload.id) == []
    assert uploads.uploads_expire() == []


def test_the_sweep_expires_only_the_uploads_past_their_expiry(openai_a, django_capture_on_commit_callbacks):
    """Beat runs the sweep every minute: an upload with time left keeps its status, its parts and its
    completion, while the one whose expiry passed a second ago ends."""
    late, fresh = start(openai_a), start(openai_a)
    send_parts(openai_a, late.id, thirds(DATA)[:1])
    first = send_parts(openai_a, fresh.id, thirds(DATA)[:1])
    now = timezone.now()
    Upload.objects.filter(pk=int(late.id.removeprefix("upload_"))).update(expires_at=now - timedelta(seconds=1))
    Upload.objects.filter(pk=int(fresh.id.removeprefix("upload_"))).update(expires_at=now + timedelta(seconds=60))
    with django_capture_on_commit_callbacks(execute=True):
        assert uploads.uploads_expire() == [int(late.id.removeprefix("upload_"))]
    statuses = dict(Upload.objects.values_list("pk", "status"))
    assert [statuses[int(upload.id.removeprefix("upload_"))] for upload in (late, fresh)] == ["expired", "pending"]
    assert stored_parts(late.id) == [] and len(stored_parts(fresh.id)) == 1
    # The one with time left still takes parts and completes.
    rest = send_parts(openai_a, fresh.id, thirds(DATA)[1:])
    done = openai_a.uploads.complete(fresh.id, part_ids=first + rest)
    assert done.status == "completed"


def test_another_tenants_upload_is_a_404(openai_a, openai_b):
    upload = start(openai_a)
    part_ids = send_parts(openai_a, upload.id, [DATA])
    for call in (lambda: openai_b.uploads.parts.create(upload.id, data=DATA),
                 lambda: openai_b.uploads.complete(upload.id, part_ids=part_ids),
                 lambda: openai_b.uploads.cancel(upload.id)):
        with pytest.raises(openai.NotFoundError) as raised:
            call()
        assert error_of(raised)["code"] == "upload_not_found"
    assert Upload.objects.get().status == "pending" and UploadPart.objects.count() == 1 and nothing_completed()


@pytest.mark.parametrize("fields, status, param, code", [
    ({"purpose": "batch"}, 400, "purpose", "invalid_purpose"),
    ({"bytes": 0}, 400, "bytes", None),
    ({"bytes": 10**12}, 413, "bytes", "dataset_too_large"),
    ({"mime_type": "image/png"}, 400, "mime_type", "invalid_mime_type"),
    ({"filename": ""}, 400, "filename", None),
    ({"expires_after": {"anchor": "created_at", "seconds": 3600}}, 400, "expires_after", "unsupported_parameter"),
    ({"colour": "red"}, 400, "colour", "unknown_parameter"),
])
def test_bad_upload_requests_name_the_field_and_create_nothing(openai_a, fields, status, param, code):
    body = {"filename": "train.jsonl", "purpose": "fine-tune", "bytes": len(DATA), "mime_type": MIME, **fields}
    with pytest.raises(openai.APIStatusError) as raised:
        openai_a.post("/uploads", body=body, cast_to=object)
    assert raised.value.status_code == status
    assert error_of(raised)["param"] == param and (code is None or error_of(raised)["code"] == code)
    assert not Upload.objects.exists()


def test_pending_uploads_per_tenant_are_limited(openai_a, settings):
    settings.TRAINING_MAX_PENDING_UPLOADS = 2
    for _ in range(2):
        start(openai_a)
    with pytest.raises(openai.PermissionDeniedError) as raised:
        start(openai_a)
    assert error_of(raised)["code"] == "upload_limit_reached" and Upload.objects.count() == 2


def test_on_s3_a_refused_completion_leaves_no_object_and_the_right_one_completes(openai_a, settings, s3_bucket,
                                                                                 moto_s3_endpoint):
    """The checks raise inside boto3's upload of the streamed file, which then keeps nothing."""
    settings.STORAGE_URL = f"s3://{s3_bucket}/loraplex"
    settings.S3_ENDPOINT_URL = moto_s3_endpoint
    upload = start(openai_a)
    part_ids = send_parts(openai_a, upload.id, thirds(DATA))
    assert len(stored_parts(upload.id)) == 3
    with pytest.raises(openai.BadRequestError) as raised:
        openai_a.uploads.complete(upload.id, part_ids=part_ids, md5="0" * 32)
    assert error_of(raised)["code"] == "md5_mismatch" and nothing_completed()
    done = openai_a.uploads.complete(upload.id, part_ids=part_ids, md5=hashlib.md5(DATA).hexdigest())
    assert openai_a.files.content(done.file.id).content == DATA


def test_the_sdks_chunked_upload_helper_sends_a_file_in_parts(openai_a):
    done = openai_a.uploads.upload_file_chunked(file=DATA, filename="train.jsonl", bytes=len(DATA), mime_type=MIME,
                                                purpose="fine-tune", part_size=len(DATA) // 3 + 1,
                                                md5=hashlib.md5(DATA).hexdigest())
    assert done.status == "completed" and openai_a.files.content(done.file.id).content == DATA
    assert Upload.objects.get().dataset_id == int(done.file.id.removeprefix("file-"))
