"""A request through a real web process to a real serving worker, both logging JSON lines (the
default outside `make up`): its request id (the caller's X-Request-ID when well-formed, else minted)
comes back in the response, is in the access line of both processes and on the usage record; every
line of both logs is a JSON object; a Django warning is written once."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from runtime.settings import PlatformSettings
from tests.gateway.conftest import wait_for_worker

pytestmark = pytest.mark.django_db(transaction=True)

# A base model name of this file's own: its web process routes only to its own worker.
BASE = "rid-base"
KEYS = {"ts", "level", "logger", "message"}


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def access_line(lines: list[dict[str, Any]], logger: str, request_id: str) -> dict[str, Any]:
    found = [line for line in lines if line["logger"] == logger and line.get("request_id") == request_id]
    assert len(found) == 1, f"{len(found)} access lines of {request_id} from {logger}"
    return found[0]


def wait_recorded(request_id: str):
    from serving.registry.models import UsageRecord
    from serving.registry.usage import usage_records_flush

    deadline = time.monotonic() + 30
    while not UsageRecord.objects.filter(request_id=request_id).exists():
        usage_records_flush()
        assert time.monotonic() < deadline, f"no usage record for {request_id}"
        time.sleep(0.1)
    return UsageRecord.objects.get(request_id=request_id)


def until_logged(process, text: str) -> str:
    deadline = time.monotonic() + 15
    while text not in (log := process.log_path.read_text(errors="replace")):
        assert time.monotonic() < deadline, f"{text!r} never logged"
        time.sleep(0.1)
    return log


@pytest.fixture(scope="module")
def processes(start_web, start_worker):
    """The file's web process and worker, started once: each test's request ids and paths are its own."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        # Unset, LOG_FORMAT is json (the workers inherit this environment); DEBUG, where Django's own
        # handler printed each warning a second time.
        monkeypatch.delenv("LOG_FORMAT", raising=False)
        assert PlatformSettings.model_fields["log_format"].default == "json"
        worker = start_worker("rid-worker", "--served-model-name", BASE)
        web = start_web(BASE_MODEL_NAME=BASE, DJANGO_DEBUG="true")
    return web, worker


@pytest.fixture
def platform(processes, redis_client):
    wait_for_worker(redis_client, "rid-worker")  # registered again after this test's Redis flush
    return processes


def test_the_request_id_follows_the_request_into_both_logs_and_the_usage_record(platform, tenant_a) -> None:
    web, worker = platform
    headers = {"Authorization": f"Bearer {tenant_a.key}"}
    body = {"model": BASE, "prompt": "count", "max_tokens": 3, "ignore_eos": True}
    given = httpx.post(f"{web.url}/v1/completions", headers={**headers, "X-Request-ID": "client-42.a"}, json=body,
                       timeout=120)
    assert given.status_code == 200, given.text
    assert given.headers["x-request-id"] == "client-42.a"
    streamed = httpx.post(f"{web.url}/v1/completions", headers={**headers, "X-Request-ID": "two words"},
                          json={**body, "stream": True}, timeout=120)
    minted = streamed.headers["x-request-id"]
    assert streamed.status_code == 200 and minted.startswith("req-") and minted != "two words"

    for request_id, tokens in (("client-42.a", given.json()["usage"]["completion_tokens"]), (minted, 3)):
        record = wait_recorded(request_id)
        assert record.status == "ok" and record.worker == "rid-worker" and record.completion_tokens == tokens
        gateway = access_line(json_lines(until_logged(web, request_id)), "lora_platform.access", request_id)
        assert gateway["method"] == "POST" and gateway["path"] == "/v1/completions" and gateway["status"] == 200
        assert gateway["tenant"] == tenant_a.tenant.slug and gateway["model"] == BASE and gateway["duration_ms"] > 0
        served = access_line(json_lines(until_logged(worker, request_id)), "serving.engine.server.access", request_id)
        assert served["path"] == "/v1/completions" and served["status"] == 200 and served["model"] == BASE
        assert served["outcome"] == "ok" and served["completion_tokens"] == tokens
        assert served["completion_id"].startswith("cmpl-")

    for process in (web, worker):
        lines = json_lines(process.log_path.read_text(errors="replace"))
        assert lines and all(KEYS <= set(line) for line in lines), "every line is a JSON object with the keys"


def test_a_refused_request_has_an_id_and_one_line_and_a_django_warning_is_written_once(platform) -> None:
    web, _ = platform
    refused = httpx.post(f"{web.url}/v1/completions", headers={"Authorization": "Bearer lp-nope.nope"},
                         json={"model": BASE, "prompt": "x"}, timeout=60)
    assert refused.status_code == 401
    request_id = refused.headers["x-request-id"]
    line = access_line(json_lines(until_logged(web, request_id)), "lora_platform.access", request_id)
    assert line["status"] == 401 and "tenant" not in line

    missing = httpx.get(f"{web.url}/api/v1/no-such-thing", timeout=60)
    assert missing.status_code == 404 and missing.headers["x-request-id"].startswith("req-")
    log = until_logged(web, "Not Found: /api/v1/no-such-thing")
    warnings = [line for line in json_lines(log) if line["logger"] == "django.request"
                and line["message"] == "Not Found: /api/v1/no-such-thing"]
    assert len(warnings) == 1 and warnings[0]["level"] == "WARNING"
    assert warnings[0]["request_id"] == missing.headers["x-request-id"], "Django's lines carry the request id too"
