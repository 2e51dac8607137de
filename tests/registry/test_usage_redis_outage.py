"""`/api/v1/usage` while Redis is away (issue 23, item 8): an answer from the database, not a 500.

The usage API first moves the gateway's queued records (a Redis list) into the database. With Redis
down (nothing listening) or frozen (a server that accepts connections and never answers), that step
cannot run: the API answers what the database holds and says the answer may be incomplete
(`complete: false`). It tries Redis once (one connection, bounded by the socket timeout; no retries
that multiply the wait) and then leaves it alone for a while, so a frozen Redis costs one timeout,
not one per request.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from datetime import datetime, timezone

import pytest

from serving.contracts.usage_log import QUEUE_KEY, UsageEvent
from serving.registry.models import UsageRecord
from tests.conftest import free_port

pytestmark = pytest.mark.django_db


class SilentServer:
    """A TCP server that accepts every connection and never sends a byte: a frozen Redis, as the
    kernel sees it. Counts the connections it accepted."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.accepted:
            conn.close()


@pytest.fixture
def silent_redis(settings) -> Iterator[SilentServer]:
    server = SilentServer()
    settings.REDIS_URL = f"redis://127.0.0.1:{server.port}/0"
    settings.REDIS_SOCKET_TIMEOUT = 0.3
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def written(tenant_a) -> UsageRecord:
    """One request already in the database."""
    return UsageRecord.objects.create(
        tenant=tenant_a.tenant, api_key_prefix="abc", request_id="req-db", endpoint="chat.completions",
        model="gw-tiny-llama", prompt_tokens=7, completion_tokens=5, status=UsageRecord.Status.OK, http_status=200,
        latency_ms=12.0, created_at=datetime.now(timezone.utc))


def test_frozen_redis_answers_from_the_database(client_a, written, silent_redis) -> None:
    response = client_a.get("/api/v1/usage")
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["complete"] is False
    assert body["totals"]["requests"] == 1 and body["totals"]["total_tokens"] == 12
    assert len(silent_redis.accepted) == 1, "one bounded attempt, no retries on a frozen Redis"

    again = client_a.get("/api/v1/usage?group_by=adapter")
    assert again.status_code == 200 and again.json()["complete"] is False
    assert len(silent_redis.accepted) == 1, "a Redis just found frozen is not tried again at once"


def test_down_redis_answers_from_the_database(client_a, written, settings) -> None:
    settings.REDIS_URL = f"redis://127.0.0.1:{free_port()}/0"
    response = client_a.get("/api/v1/usage?group_by=day")
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["complete"] is False and body["totals"]["requests"] == 1
    assert [row["requests"] for row in body["data"]] == [1]


def test_reachable_redis_counts_the_queued_records(client_a, written, tenant_a, own_redis) -> None:
    event = UsageEvent(request_id="req-queued", tenant_id=tenant_a.tenant.pk, api_key_prefix="abc",
                       endpoint="chat.completions", model="gw-tiny-llama", adapter="", version="", prompt_tokens=3,
                       completion_tokens=2, status="ok", http_status=200, latency_ms=9.0, ttft_ms=None, degraded=False,
                       worker="w1", created_at=datetime.now(timezone.utc).timestamp())
    own_redis.rpush(QUEUE_KEY, event.dumps())
    body = client_a.get("/api/v1/usage").json()
    assert body["complete"] is True
    assert body["totals"]["requests"] == 2 and body["totals"]["total_tokens"] == 17
    assert own_redis.llen(QUEUE_KEY) == 0, "the usage API moved the queued record into the database"
