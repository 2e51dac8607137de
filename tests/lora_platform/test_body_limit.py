"""Issue 23, item 5: an oversized body is refused at the ASGI level, before it is buffered, on every
route (by its Content-Length, and while a chunked one streams); the upload routes take the larger
upload limit only from a caller whose credentials are valid. Against the web process over sockets:
the server's own write count (/proc/<pid>/io) shows that no body was spooled to a temporary file."""

from __future__ import annotations

import json
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.urls import reverse

from lora_platform.body_limit import UPLOAD_VIEWS
from tests.lora_platform.live_web import LiveWeb, read_response, web_env

pytestmark = pytest.mark.django_db(transaction=True)

LIMIT = 64 * 1024
UPLOAD_LIMIT = 1024 * 1024
SIX_HUNDRED_MB = 600 * 1000 * 1000
PIECE = 1024 * 1024


@pytest.fixture(scope="module")
def web(django_db_setup, django_db_blocker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveWeb]:
    tmp = tmp_path_factory.mktemp("body-limit")
    with django_db_blocker.unblock():
        env = web_env(tmp)
    server = LiveWeb({**env, "DATA_UPLOAD_MAX_MEMORY_SIZE": str(LIMIT), "MAX_UPLOAD_BYTES": str(UPLOAD_LIMIT)},
                     tmp / "web.log")
    yield server
    server.stop()


def _split(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of the first response in `raw`."""
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split(" ", 2)[1]), headers, body[:int(headers.get("content-length", len(body)))]


class _Sender(threading.Thread):
    """Streams `total` bytes of body as an attacker would (without waiting for an answer), until
    the server closes the connection; counts what it got out."""

    def __init__(self, sock, total: int, *, chunked: bool) -> None:
        super().__init__(daemon=True)
        self.sock, self.total, self.chunked = sock, total, chunked
        self.sent = 0
        self.stopped_by: OSError | None = None

    def run(self) -> None:
        try:
            while self.sent < self.total:
                piece = b"x" * min(PIECE, self.total - self.sent)
                self.sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if self.chunked else piece)
                self.sent += len(piece)
            if self.chunked:
                self.sock.sendall(b"0\r\n\r\n")
        except OSError as error:
            self.stopped_by = error


def _post(web: LiveWeb, path: str, *, headers: dict[str, str], total: int, chunked: bool = False
          ) -> tuple[int, dict[str, str], dict, _Sender, int]:
    """POST a body of `total` bytes while reading the answer; (status, headers, JSON body, the
    sender, bytes the server wrote meanwhile)."""
    written_before = web.written_bytes()
    sock = web.connect(timeout=120)
    framing = {"Transfer-Encoding": "chunked"} if chunked else {"Content-Length": str(total)}
    head = "".join(f"{name}: {value}\r\n" for name, value in {"Host": f"127.0.0.1:{web.port}", **framing, **headers}.items())
    sock.sendall(f"POST {path} HTTP/1.1\r\n{head}\r\n".encode())
    sender = _Sender(sock, total, chunked=chunked)
    sender.start()
    raw = read_response(sock)
    sender.join(120)
    sock.close()
    status, response_headers, body = _split(raw)
    return status, response_headers, json.loads(body), sender, web.written_bytes() - written_before


@pytest.mark.parametrize("path", ["/api/v1/tenant", "/login/", "/api/v1/datasets"])
def test_a_declared_600_mb_body_without_credentials_is_refused_before_it_is_read(web, path):
    status, headers, body, sender, written = _post(web, path, headers={"Content-Type": "application/json"},
                                                   total=SIX_HUNDRED_MB)
    assert status == 413, body
    assert body["error"]["code"] == "payload_too_large" and body["error"]["type"] == "invalid_request_error"
    assert f"{SIX_HUNDRED_MB} bytes" in body["error"]["message"] and f"{LIMIT} bytes" in body["error"]["message"]
    assert headers["connection"] == "close"
    # The server closed the connection: the sender was cut off long before its 600 MB …
    assert sender.stopped_by is not None and sender.sent < SIX_HUNDRED_MB
    # … and nothing of the body was written anywhere (a spooled body would be ~600 MB of writes).
    assert written < LIMIT


@pytest.mark.parametrize("path", ["/api/v1/tenant", "/login/"])
def test_a_chunked_body_is_refused_once_past_the_limit(web, path):
    status, headers, body, sender, written = _post(web, path, headers={"Content-Type": "application/json"},
                                                   total=SIX_HUNDRED_MB, chunked=True)
    assert status == 413, body
    assert body["error"]["code"] == "payload_too_large" and f"{LIMIT} bytes" in body["error"]["message"]
    assert headers["connection"] == "close"
    assert sender.stopped_by is not None and sender.sent < SIX_HUNDRED_MB
    assert written < LIMIT


def _multipart(size: int, boundary: str = "loraplex-test-boundary") -> tuple[dict[str, str], bytes]:
    line = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
    rows = (line + "\n") * (size // (len(line) + 1) + 1)
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"train.jsonl\"\r\n"
            f"Content-Type: application/jsonl\r\n\r\n{rows}\r\n--{boundary}--\r\n").encode()
    return {"Content-Type": f"multipart/form-data; boundary={boundary}"}, body


def _send(web: LiveWeb, path: str, headers: dict[str, str], body: bytes) -> tuple[int, bytes]:
    sock = web.connect(timeout=120)
    head = "".join(f"{name}: {value}\r\n" for name, value in
                   {"Host": f"127.0.0.1:{web.port}", "Content-Length": str(len(body)), "Connection": "close", **headers}.items())
    sock.sendall(f"POST {path} HTTP/1.1\r\n{head}\r\n".encode())
    try:
        sock.sendall(body)
    except OSError:  # refused and closed before the whole body went out
        pass
    status, _, payload = _split(read_response(sock))
    sock.close()
    return status, payload


def test_an_upload_route_takes_the_upload_limit_only_with_valid_credentials(web, tenant_a):
    from tenants.services import api_key_create

    multipart, upload = _multipart(3 * LIMIT)  # over the default limit, within the upload limit
    assert LIMIT < len(upload) < UPLOAD_LIMIT
    wrong_key = tenant_a.key[:-4] + ("aaaa" if not tenant_a.key.endswith("aaaa") else "bbbb")
    _, inference_only = api_key_create(tenant=tenant_a.tenant, name="inference", scopes=["inference"])
    for credentials in ({}, {"Authorization": f"Bearer {wrong_key}"}, {"Authorization": f"Bearer {inference_only}"},
                        {"Authorization": "Bearer not-a-key"}, {"Cookie": f"sessionid={secrets.token_hex(16)}"}):
        status, payload = _send(web, "/api/v1/datasets", {**multipart, **credentials}, upload)
        assert status == 413, (credentials, payload)
        message = json.loads(payload)["error"]["message"]
        assert f"{LIMIT} bytes" in message and "credentials" in message, message

    for path in ("/api/v1/datasets", "/v1/files"):
        form = upload.replace(b"--loraplex-test-boundary--", b"--loraplex-test-boundary\r\nContent-Disposition: "
                              b"form-data; name=\"purpose\"\r\n\r\nfine-tune\r\n--loraplex-test-boundary--")
        status, payload = _send(web, path, {**multipart, "Authorization": f"Bearer {tenant_a.key}"}, form)
        assert status in (200, 201), payload
        assert json.loads(payload)["bytes"] > LIMIT

    multipart, too_big = _multipart(UPLOAD_LIMIT + 1)
    status, payload = _send(web, "/api/v1/datasets", {**multipart, "Authorization": f"Bearer {tenant_a.key}"}, too_big)
    assert status == 413 and f"{UPLOAD_LIMIT} bytes" in json.loads(payload)["error"]["message"]


def test_a_dashboard_session_takes_the_upload_limit(web, tenant_a, client):
    from django.contrib.auth import get_user_model

    from tenants.models import Membership

    user = get_user_model().objects.create_user(username="uploader", password="pw-uploader-1")
    Membership.objects.create(user=user, tenant=tenant_a.tenant, role=Membership.Role.MEMBER)
    client.force_login(user)
    session = client.cookies["sessionid"].value
    token = secrets.token_hex(32)  # a 64-character CSRF token, the cookie and the form field agreeing
    boundary = "loraplex-test-boundary"
    multipart, upload = _multipart(3 * LIMIT, boundary)
    upload = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"csrfmiddlewaretoken\"\r\n\r\n{token}\r\n"
              .encode() + upload)
    headers = {**multipart, "Cookie": f"sessionid={session}; csrftoken={token}", "Referer": web.url,
               "Origin": web.url}
    status, payload = _send(web, "/datasets/upload/", headers, upload)
    assert status == 302, payload  # uploaded: the dashboard redirects to the dataset
    assert tenant_a.tenant.datasets.count() == 1

    # No session, or the session of a viewer (who may not upload): the small limit.
    status, payload = _send(web, "/datasets/upload/", {**headers, "Cookie": f"csrftoken={token}"}, upload)
    assert status == 413 and "credentials" in json.loads(payload)["error"]["message"]
    Membership.objects.filter(user=user).update(role=Membership.Role.VIEWER)
    status, payload = _send(web, "/datasets/upload/", headers, upload)
    assert status == 413 and "credentials" in json.loads(payload)["error"]["message"]


def test_the_upload_views_exist():
    """A renamed upload route would silently fall back to the small limit."""
    for name in UPLOAD_VIEWS:
        kwargs = {"name": "x"} if "adapter" in name else {"upload_id": "x"} if name == "openai-upload-parts" else None
        assert reverse(name, kwargs=kwargs)
