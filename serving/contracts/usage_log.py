"""Usage records off the request path: each finished request appends one JSON record to a Redis
list (one RPUSH, pipelined with the token refund), and a flusher moves them to the database in
batches (serving.registry.usage). A contract: the gateway writes the queue, the registry's flusher
reads it, in any web process. Redis holds what is not written yet, so a web process that dies loses
nothing it had recorded, and any process may flush what another recorded.

A record carries the request's id (X-Request-ID, which a caller may choose, so it may repeat) and
an id of its own, minted with it (`record_id`): a record pushed twice (kept in memory while Redis
seemed away, though the push had reached it) is written once.

Records leave the queue only once written. A flusher holds the flush lock (one flusher at a time
across the web processes), reads the queue's head without taking it (`usage_peek`), writes it, and
only then trims what it wrote (`usage_trim`, which trims only while the lock is still its own). A
pop whose reply never came back (Redis cut off between executing it and answering) took records
that no one then wrote; with the read-write-trim order the worst such a cut does is a head written
twice, which the record ids make one row each."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import redis
import redis.asyncio as aioredis

QUEUE_KEY = "loraplex:gateway:usage"
# Held by the process flushing the queue (its token), for at most FLUSH_LOCK_TTL_MS past its last batch.
FLUSH_LOCK_KEY = "loraplex:gateway:usage:flushing"
FLUSH_LOCK_TTL_MS = 30_000

# The head's `ARGV[2]` entries off the queue, and the lock's lease renewed, only while the lock is
# still the caller's (ARGV[1]): a flusher whose lease ran out leaves the head to the one that took
# the lock over, which writes it again (one row each, by record id) and trims it itself.
_TRIM = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
redis.call('LTRIM', KEYS[1], tonumber(ARGV[2]), -1)
redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[3]))
return 1
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


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


def usage_flush_lock(client: redis.Redis, *, wait_s: float) -> str | None:
    """The flush lock's token once this process holds it, waiting up to `wait_s` for another
    flusher to finish; None when it is still held then."""
    token = uuid.uuid4().hex
    deadline = time.monotonic() + wait_s
    while not client.set(FLUSH_LOCK_KEY, token, nx=True, px=FLUSH_LOCK_TTL_MS):
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.02)
    return token


def usage_flush_unlock(client: redis.Redis, token: str) -> None:
    client.eval(_RELEASE, 1, FLUSH_LOCK_KEY, token)


def usage_peek(client: redis.Redis, count: int) -> tuple[list[UsageEvent], int]:
    """Up to `count` records at the queue's head, oldest first, left on the queue, and how many
    entries that head holds (malformed ones are skipped, and trimmed with the rest)."""
    raw = client.lrange(QUEUE_KEY, 0, count - 1)
    events = []
    for item in raw:
        try:
            events.append(UsageEvent.loads(item))
        except (ValueError, TypeError):
            continue
    return events, len(raw)


def usage_trim(client: redis.Redis, token: str, count: int) -> bool:
    """Drop the `count` entries at the queue's head (written by the caller); False, dropping none,
    when the flush lock is no longer `token`'s."""
    return bool(client.eval(_TRIM, 2, QUEUE_KEY, FLUSH_LOCK_KEY, token, count, FLUSH_LOCK_TTL_MS))
