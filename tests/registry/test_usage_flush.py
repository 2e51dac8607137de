"""The usage flusher moves the gateway's queued records (a Redis list) into the database without
losing any: records leave the queue only once written, one flusher at a time across processes
(serving.contracts.usage_log). Before, a flusher popped its batch (LPOP) and then wrote it: a
connection cut between Redis executing the pop and its reply arriving lost the batch (seen as
"84 usage records for 86 requests" after a Redis cut-off in the gateway's fault suite)."""

from __future__ import annotations

import threading
from datetime import datetime, timezone

import pytest
from django.db import connection

import serving.registry.usage
from serving.contracts.usage_log import FLUSH_LOCK_KEY, QUEUE_KEY, UsageEvent, usage_flush_lock, usage_peek, usage_trim
from serving.registry.models import UsageRecord
from serving.registry.usage import usage_records_flush

pytestmark = pytest.mark.django_db


def _events(tenant_id: int, count: int) -> list[UsageEvent]:
    return [UsageEvent(request_id=f"req-{i}", tenant_id=tenant_id, api_key_prefix="abc", endpoint="chat.completions",
                       model="gw-tiny-llama", adapter="", version="", prompt_tokens=3, completion_tokens=2, status="ok",
                       http_status=200, latency_ms=9.0, ttft_ms=None, degraded=False, worker="w1",
                       created_at=datetime.now(timezone.utc).timestamp())
            for i in range(count)]  # fmt: skip


def test_the_head_leaves_the_queue_only_once_written(tenant_a, own_redis) -> None:
    own_redis.rpush(QUEUE_KEY, *[event.dumps() for event in _events(tenant_a.tenant.pk, 3)])
    events, taken = usage_peek(own_redis, 10)
    assert [event.request_id for event in events] == ["req-0", "req-1", "req-2"] and taken == 3
    assert own_redis.llen(QUEUE_KEY) == 3, "reading the head takes nothing off the queue"
    # Only the flush lock's holder trims, and only what it says it wrote.
    assert usage_trim(own_redis, "not-the-holder", 3) is False and own_redis.llen(QUEUE_KEY) == 3
    token = usage_flush_lock(own_redis, wait_s=0)
    assert token is not None and usage_flush_lock(own_redis, wait_s=0) is None, "one flusher at a time"
    assert usage_trim(own_redis, token, 2) is True and own_redis.llen(QUEUE_KEY) == 1
    assert own_redis.pttl(FLUSH_LOCK_KEY) > 0, "the holder's lease runs on"


def test_a_head_written_twice_is_one_row_each(tenant_a, own_redis) -> None:
    """What a flusher whose trim never took effect (its reply lost, its lease expired) leaves: the
    head it wrote still queued, written again by the next flush."""
    events = _events(tenant_a.tenant.pk, 2)
    own_redis.rpush(QUEUE_KEY, *[event.dumps() for event in events])
    assert usage_records_flush() == 2
    own_redis.rpush(QUEUE_KEY, *[event.dumps() for event in events])
    usage_records_flush()
    assert own_redis.llen(QUEUE_KEY) == 0
    assert sorted(UsageRecord.objects.values_list("request_id", flat=True)) == ["req-0", "req-1"]


def test_a_flush_waits_for_the_one_holding_the_lock(tenant_a, own_redis, client_a, monkeypatch) -> None:
    own_redis.rpush(QUEUE_KEY, *[event.dumps() for event in _events(tenant_a.tenant.pk, 2)])
    own_redis.set(FLUSH_LOCK_KEY, "another-process")
    assert usage_records_flush(wait_s=0.1) is None
    assert own_redis.llen(QUEUE_KEY) == 2 and not UsageRecord.objects.exists()
    # The usage API answers from the database then, and says the queued records are missing.
    monkeypatch.setattr(serving.registry.usage, "READ_FLUSH_WAIT_S", 0.1)
    body = client_a.get("/api/v1/usage").json()
    assert body["complete"] is False and body["totals"]["requests"] == 0
    own_redis.delete(FLUSH_LOCK_KEY)
    body = client_a.get("/api/v1/usage").json()
    assert body["complete"] is True and body["totals"]["requests"] == 2
    assert own_redis.llen(QUEUE_KEY) == 0 and not own_redis.exists(FLUSH_LOCK_KEY), "the lock is let go"


def test_a_record_pushed_between_the_peek_and_the_trim_stays_queued(tenant_a, own_redis, monkeypatch) -> None:
    """A request finishing while the flusher writes pushes its record behind the head: the trim takes
    only the entries the flusher read, so that record is written by the next flush, not dropped."""
    early, late = _events(tenant_a.tenant.pk, 2), _events(tenant_a.tenant.pk, 3)[2:]
    own_redis.rpush(QUEUE_KEY, *[event.dumps() for event in early])
    peeks = []

    def peek_then_push(client, count: int):
        head = usage_peek(client, count)
        if not peeks:
            client.rpush(QUEUE_KEY, late[0].dumps())
        peeks.append(head[1])
        return head

    monkeypatch.setattr(serving.registry.usage, "usage_peek", peek_then_push)
    assert usage_records_flush(batch=10) == 2 and peeks == [2]
    assert [UsageEvent.loads(raw).request_id for raw in own_redis.lrange(QUEUE_KEY, 0, -1)] == ["req-2"]
    assert usage_records_flush(batch=10) == 1 and own_redis.llen(QUEUE_KEY) == 0
    assert sorted(UsageRecord.objects.values_list("request_id", flat=True)) == ["req-0", "req-1", "req-2"]


@pytest.mark.django_db(transaction=True)
def test_flushers_in_parallel_write_every_record_once(tenant_a, own_redis) -> None:
    total = 1200
    own_redis.rpush(QUEUE_KEY, *[event.dumps() for event in _events(tenant_a.tenant.pk, total)])
    errors: list[BaseException] = []

    def flusher() -> None:
        try:
            while own_redis.llen(QUEUE_KEY):
                usage_records_flush(batch=50, wait_s=5)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=flusher) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors
    assert own_redis.llen(QUEUE_KEY) == 0
    ids = list(UsageRecord.objects.values_list("request_id", flat=True))
    assert len(ids) == total and len(set(ids)) == total
