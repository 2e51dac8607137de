"""Usage records off the request path: each finished request appends one JSON record to a Redis
list (one RPUSH, pipelined with the token refund), and a flusher moves them to the database in
batches (serving.usage). Redis holds what is not written yet, so a web process that dies loses
nothing it had recorded, and any process may flush what another recorded.

A record carries the request's id (X-Request-ID, which a caller may choose, so it may repeat) and
an id of its own, minted with it (`record_id`): a record pushed twice (kept in memory while Redis
seemed away, though the push had reached it) is written once."""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import redis
import redis.asyncio as aioredis

QUEUE_KEY = "loraplex:gateway:usage"


@dataclass(frozen=True)
class UsageEvent:
    request_id: str
    tenant_id: int
    api_key_prefix: str
    endpoint: str
    model: str
    adapter: str
    version: str
    prompt_tokens: int
    completion_tokens: int
    status: str
    http_status: int
    latency_ms: float
    ttft_ms: float | None
    degraded: bool
    worker: str
    created_at: float  # unix seconds
    # Records queued by a process from before record ids get one when read.
    record_id: str = field(default_factory=lambda: uuid.uuid4().hex)

    def dumps(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def loads(cls, text: bytes | str) -> UsageEvent:
        data: dict[str, Any] = json.loads(text)
        return cls(**data)


def usage_push(pipe: aioredis.client.Pipeline, event: UsageEvent) -> None:
    """Queue the record on a pipeline the caller executes (so it costs no round trip of its own)."""
    pipe.rpush(QUEUE_KEY, event.dumps())


def usage_pop(client: redis.Redis, count: int) -> list[UsageEvent]:
    """Take up to `count` records off the queue, oldest first (LPOP is atomic: two flushers never
    take the same record). Malformed entries are dropped."""
    # With a count, LPOP answers a list (or None when the queue is empty).
    raw = cast("list[bytes | str] | None", client.lpop(QUEUE_KEY, count)) or []
    events = []
    for item in raw:
        try:
            events.append(UsageEvent.loads(item))
        except (ValueError, TypeError):
            continue
    return events


def usage_requeue(client: redis.Redis, events: list[UsageEvent]) -> None:
    """Put records back at the head (the database refused them; the next flush retries)."""
    if events:
        client.lpush(QUEUE_KEY, *[event.dumps() for event in reversed(events)])
