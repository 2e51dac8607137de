"""Issue 37, item 6: an authenticated upload is refused at its tier's limit while it streams, before
it reaches disk. Two layers: the ASGI body limit (lora_platform.body_limit) stops the body at the
caller's tier limit (plus the form's allowance) before Django spools it, checked against the web
process over sockets by its write count; the upload handlers stop the file at the exact limit and
delete what they wrote, checked in-process by the bytes handed to FILE_UPLOAD_TEMP_DIR's files."""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator

import pytest
from django.core.files.uploadhandler import TemporaryFileUploadHandler

from tests.lora_platform.live_web import LiveWeb, web_env
from tests.lora_platform.test_body_limit import _multipart, _post, _send

TIER_LIMIT = 64 * 1024
FORM_ALLOWANCE = 16 * 1024  # DATA_UPLOAD_MAX_MEMORY_SIZE of the live web process
UPLOAD_CEILING = 8 * 1024 * 1024  # MAX_UPLOAD_BYTES of the live web process: far above the tier's limit


@pytest.fixture
def temp_writes(settings, tmp_path, monkeypatch) -> Iterator[list[int]]:
    """Upload temp files go to a folder of the test's; the sizes of the chunks written to them."""
    settings.FILE_UPLOAD_TEMP_DIR = str(tmp_path)
    settings.TRAINING_DATASET_MAX_BYTES_BY_TIER = f"standard={TIER_LIMIT}"
    written: list[int] = []
    original = TemporaryFileUploadHandler.receive_data_chunk

    def counting(self, raw_data: bytes, start: int) -> bytes | None:
        written.append(len(raw_data))
        return original(self, raw_data, start)

    monkeypatch.setattr(TemporaryFileUploadHandler, "receive_data_chunk", counting)
    yield written


def _rows(size: int) -> bytes:
    line = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
    return ((line + "\n") * (size // (len(line) + 1) + 1)).encode()


@pytest.mark.django_db
@pytest.mark.parametrize("path", ["/api/v1/datasets", "/v1/files"])
def test_an_api_upload_over_the_tier_limit_is_a_413_and_leaves_no_temp_file(client, tenant_a, temp_writes, tmp_path,
                                                                             path):
    from django.core.files.uploadedfile import SimpleUploadedFile

    upload = SimpleUploadedFile("train.jsonl", _rows(4 * TIER_LIMIT), content_type="application/jsonl")
    response = client.post(path, {"file": upload, "purpose": "fine-tune"}, HTTP_AUTHORIZATION=f"Bearer {tenant_a.key}")
    assert response.status_code == 413, response.content
    error = response.json()["error"]
    assert error["code"] == "dataset_too_large" and f"{TIER_LIMIT} bytes" in error["message"]
    assert "tier 'standard'" in error["message"]
    assert sum(temp_writes) <= TIER_LIMIT
    # The response (and so the request and its upload handler) is still alive: the file is gone anyway.
    assert list(tmp_path.iterdir()) == []
    assert not tenant_a.tenant.datasets.exists()


@pytest.mark.django_db
def test_a_dashboard_upload_is_held_to_its_tiers_limit_not_the_platforms(tenant_a, temp_writes, tmp_path):
    """With the CSRF check on, as in production: it parses the form before the view names a tenant."""
    from django.contrib.auth import get_user_model
    from django.core.files.uploadedfile import SimpleUploadedFile
    from django.test import Client

    from tenants.models import Membership

    user = get_user_model().objects.create_user(username="uploader", password="pw-uploader-1")
    Membership.objects.create(user=user, tenant=tenant_a.tenant, role=Membership.Role.MEMBER)
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    token = secrets.token_hex(32)
    client.cookies["csrftoken"] = token
    upload = SimpleUploadedFile("train.jsonl", _rows(4 * TIER_LIMIT), content_type="application/jsonl")
    response = client.post("/datasets/upload/", {"file": upload, "csrfmiddlewaretoken": token}, follow=True)
    assert response.status_code == 200
    assert f"may be at most {TIER_LIMIT} bytes" in response.content.decode()
    assert sum(temp_writes) <= TIER_LIMIT  # the platform-wide limit (100 MiB) would have taken it all
    assert list(tmp_path.iterdir()) == []
    assert not tenant_a.tenant.datasets.exists()


@pytest.mark.django_db
def test_an_upload_part_is_held_to_the_tiers_limit_below_64_mib(client, tenant_a, temp_writes, tmp_path):
    from django.core.files.uploadedfile import SimpleUploadedFile

    auth = {"HTTP_AUTHORIZATION": f"Bearer {tenant_a.key}"}
    created = client.post("/v1/uploads", {"filename": "train.jsonl", "purpose": "fine-tune", "bytes": TIER_LIMIT,
                                          "mime_type": "application/jsonl"}, content_type="application/json", **auth)
    assert created.status_code == 200, created.content
    part = SimpleUploadedFile("part", _rows(4 * TIER_LIMIT), content_type="application/octet-stream")
    response = client.post(f"/v1/uploads/{created.json()['id']}/parts", {"data": part}, **auth)
    assert response.status_code == 413, response.content
    error = response.json()["error"]
    assert error["code"] == "part_too_large" and error["param"] == "data"
    assert f"{TIER_LIMIT} bytes" in error["message"] and "tier 'standard'" in error["message"]
    assert sum(temp_writes) <= TIER_LIMIT
    assert list(tmp_path.iterdir()) == []


@pytest.fixture(scope="module")
def web(django_db_setup, django_db_blocker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveWeb]:
    tmp = tmp_path_factory.mktemp("upload-tier-limits")
    with django_db_blocker.unblock():
        env = web_env(tmp)
    server = LiveWeb({**env, "DATA_UPLOAD_MAX_MEMORY_SIZE": str(FORM_ALLOWANCE), "MAX_UPLOAD_BYTES": str(UPLOAD_CEILING),
                      "TRAINING_DATASET_MAX_BYTES_BY_TIER": f"standard={TIER_LIMIT}"}, tmp / "web.log")
    yield server
    server.stop()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_the_web_process_stops_an_authenticated_upload_at_the_tiers_limit(web, tenant_a, chunked):
    """The attack run's 400 MiB on a 100 MiB tier, scaled down: 6 MiB on a 64 KiB tier, under an 8 MiB
    MAX_UPLOAD_BYTES that allowed all of it before."""
    total = 6 * 1024 * 1024
    headers = {"Content-Type": "multipart/form-data; boundary=b", "Authorization": f"Bearer {tenant_a.key}"}
    status, response_headers, body, sender, written = _post(web, "/api/v1/datasets", headers=headers, total=total,
                                                            chunked=chunked)
    assert status == 413, body
    message = body["error"]["message"]
    assert body["error"]["code"] == "payload_too_large" and response_headers["connection"] == "close"
    assert f"the limit is {TIER_LIMIT + FORM_ALLOWANCE} bytes" in message
    assert f"datasets on tier 'standard' may be at most {TIER_LIMIT} bytes" in message
    assert sender.stopped_by is not None and sender.sent < total
    # Spooled, the body would be megabytes of writes; at most the tier's limit and the form's may be.
    assert written < TIER_LIMIT + FORM_ALLOWANCE + 64 * 1024


@pytest.mark.django_db(transaction=True)
def test_within_its_tiers_limit_an_upload_is_stored_and_a_session_gets_the_same_limit(web, tenant_a, client):
    from django.contrib.auth import get_user_model

    from tenants.models import Membership

    multipart, upload = _multipart(TIER_LIMIT // 2)
    assert FORM_ALLOWANCE < len(upload) < TIER_LIMIT
    status, payload = _send(web, "/api/v1/datasets", {**multipart, "Authorization": f"Bearer {tenant_a.key}"}, upload)
    assert status == 201, payload

    user = get_user_model().objects.create_user(username="uploader", password="pw-uploader-1")
    Membership.objects.create(user=user, tenant=tenant_a.tenant, role=Membership.Role.MEMBER)
    client.force_login(user)
    token = secrets.token_hex(32)
    _, too_big = _multipart(4 * TIER_LIMIT)
    headers = {**multipart, "Cookie": f"sessionid={client.cookies['sessionid'].value}; csrftoken={token}",
               "Referer": web.url, "Origin": web.url}
    status, payload = _send(web, "/datasets/upload/", headers, too_big)
    assert status == 413, payload
    assert f"datasets on tier 'standard' may be at most {TIER_LIMIT} bytes" in json.loads(payload)["error"]["message"]
