"""The web process's probes: `/healthz` (the process answers) and `/readyz` (what it serves with is there).

`/healthz` touches nothing: 200 while the process runs its event loop. An orchestrator restarts the
process when it fails (compose's healthcheck, a Kubernetes liveness probe).

`/readyz` runs every check at once, each bounded by its own timeout, and answers 200 when every
required one passes, else 503 with `failing` naming them; each check's result and duration are in
the body (docs/operations.md, "Health and readiness"):

| check | passes when | required |
| --- | --- | --- |
| database | `SELECT 1` answers | yes |
| redis | `PING` answers | yes |
| storage | a probe object is written, read back and deleted | yes |
| serving_workers | a serving worker of the base model is live in the worker registry (fresh heartbeat, ready, this deployment's key) | yes |
| celery | a Celery worker answers a ping | no: reported only |

The Celery ping is reported but does not fail readiness: the web process serves the gateway, the
API and the dashboard without a Celery worker (training jobs and validations wait in the queue
until one comes back), so taking it out of rotation would stop inference for nothing.

Each check's `detail` and `error` name workers, Celery hosts and what failed: they are for the
operator, shown to a caller on this machine (a loopback REMOTE_ADDR: the peer, or behind
TRUSTED_PROXIES the client the proxy names) or one that sends the operator's key
(`Authorization: Bearer $SERVING_WORKER_API_KEY`). Anyone else, a load balancer's probe included,
gets the same status code and `failing`, and each check's `ok`, `required` and `seconds` only
(issue 37, item 7; docs/operations.md, "Who may read the probes and metrics").

A probe that hangs (an S3 endpoint that never answers) keeps its thread until its client gives up;
the next `/readyz` does not start another one beside it but reports the one still running, so a
dead dependency polled every few seconds never piles up threads.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from django.conf import settings
from django.db import connections
from django.http import HttpRequest, JsonResponse
from django.views.decorators.cache import never_cache

from serving.gateway.catalog import base_model_ids
from serving.gateway.routing import live_workers, read_registry
from serving.registry.storage import get_storage
from serving.contracts.registry import api_key_id

logger = logging.getLogger(__name__)

# Every check's bound; compose's healthcheck and a load balancer's probe wait a little longer.
CHECK_TIMEOUT_S = 3.0
# A Celery ping waits this long for a reply (the first one ends it); a live worker answers well within it.
CELERY_PING_TIMEOUT_S = 1.0
PROBE_PREFIX = "health"


class CheckFailed(Exception):
    """A dependency is not usable; the message says what, for whoever probes (no secrets in it)."""


@dataclass(frozen=True)
class Check:
    name: str
    probe: Callable[[], str]  # runs in a thread; returns a short detail, raises CheckFailed
    required: bool = True
    timeout_s: float = CHECK_TIMEOUT_S


@dataclass(frozen=True)
class Outcome:
    check: Check
    seconds: float
    detail: str = ""
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    def to_dict(self) -> dict[str, Any]:
        result: dict[str, Any] = {"ok": self.ok, "required": self.check.required, "seconds": round(self.seconds, 4)}
        result.update({"error": self.error} if self.error else {"detail": self.detail})
        return result


# One thread per check at most (see the module's docstring); the futures of probes still running.
_executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="readyz")
_running: dict[str, tuple[Future[str], float]] = {}


def _submit(check: Check) -> Future[str] | str:
    """The probe's future, or why none was started (the previous one has not returned)."""
    previous = _running.get(check.name)
    if previous is not None and not previous[0].done():
        return f"the previous probe has not returned for {time.monotonic() - previous[1]:.0f} s"
    future = _executor.submit(check.probe)
    _running[check.name] = (future, time.monotonic())
    return future


async def run_check(check: Check) -> Outcome:
    started = time.perf_counter()
    submitted = _submit(check)
    if isinstance(submitted, str):
        return Outcome(check, 0.0, error=submitted)
    try:
        detail = await asyncio.wait_for(asyncio.wrap_future(submitted), timeout=check.timeout_s)
    except CheckFailed as failure:
        return Outcome(check, time.perf_counter() - started, error=str(failure))
    except TimeoutError:
        return Outcome(check, time.perf_counter() - started, error=f"no answer within {check.timeout_s:g} s")
    except Exception as error:
        # Client errors may name hosts and paths: the log has them, the public answer only the kind.
        logger.warning("readiness check %s failed", check.name, exc_info=True)
        return Outcome(check, time.perf_counter() - started,
                       error=f"{type(error).__name__} (details in the web process's log)")
    return Outcome(check, time.perf_counter() - started, detail=detail)


def _database() -> str:
    connection = connections["default"]
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
    finally:
        connection.close()  # a probe thread's connection is never reused by a request
    return connection.vendor


def _redis_client() -> aioredis.Redis:
    timeout = settings.REDIS_SOCKET_TIMEOUT
    return aioredis.Redis.from_url(settings.REDIS_URL, socket_timeout=timeout, socket_connect_timeout=timeout)


def _in_loop(work: Callable[[aioredis.Redis], Awaitable[Any]]) -> Any:
    """Runs `work` on a client of its own in this probe thread's own event loop."""
    async def with_client() -> Any:
        client = _redis_client()
        try:
            return await work(client)
        finally:
            await client.aclose()

    return asyncio.run(with_client())


def _redis() -> str:
    try:
        _in_loop(lambda client: client.ping())
    except (aioredis.RedisError, OSError) as error:
        raise CheckFailed(f"Redis does not answer: {type(error).__name__}") from None
    return "PONG"


def _storage() -> str:
    storage = get_storage()
    key = f"{PROBE_PREFIX}/{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex}"
    content = key.encode()
    try:
        storage.put(key, content)
        if storage.get_bytes(key) != content:
            raise CheckFailed("the probe object read back differs from what was written")
    finally:
        storage.delete(key)
    return "write, read and delete of a probe object"


def _serving_workers() -> str:
    try:
        documents = _in_loop(read_registry)
    except (aioredis.RedisError, OSError) as error:
        raise CheckFailed(f"the worker registry (Redis) cannot be read: {type(error).__name__}") from None
    workers = live_workers(documents, base_models=base_model_ids(), key_id=api_key_id(settings.SERVING_WORKER_API_KEY))
    if not workers:
        raise CheckFailed(f"no serving worker of {settings.BASE_MODEL_NAME} is live: none in the registry has a "
                          "fresh heartbeat, state 'ready' and this deployment's key")
    return f"{len(workers)} live: {', '.join(sorted(worker.worker_id for worker in workers))}"


def _celery() -> str:
    from lora_platform.celery import app

    # limit=1: the first reply ends the wait, so a healthy probe takes milliseconds, not the timeout.
    replies = app.control.ping(timeout=CELERY_PING_TIMEOUT_S, limit=1)
    if not replies:
        raise CheckFailed(f"no Celery worker answered a ping within {CELERY_PING_TIMEOUT_S:g} s: training "
                          "jobs and dataset validations wait in the queue")
    return f"answered by {', '.join(name for reply in replies for name in reply)}"


CHECKS = (
    Check("database", _database),
    Check("redis", _redis),
    Check("storage", _storage),
    Check("serving_workers", _serving_workers),
    # Its own ping waits CELERY_PING_TIMEOUT_S for replies; the bound leaves room to connect.
    Check("celery", _celery, required=False, timeout_s=CELERY_PING_TIMEOUT_S + 1.0),
)


async def readiness(checks: tuple[Check, ...] = CHECKS) -> tuple[int, dict[str, Any]]:
    """The HTTP status and body of `/readyz`: every check run at once."""
    outcomes = await asyncio.gather(*(run_check(check) for check in checks))
    failing = [outcome.check.name for outcome in outcomes if not outcome.ok and outcome.check.required]
    body = {"status": "not_ready" if failing else "ready", "failing": failing,
            "checks": {outcome.check.name: outcome.to_dict() for outcome in outcomes}}
    return (503 if failing else 200), body


@never_cache
async def healthz(request: HttpRequest) -> JsonResponse:
    """Alive: the process answers. No dependency is touched."""
    return JsonResponse({"status": "alive"})


_last_failing: list[str] = []
# What an anonymous caller sees of a check (the module's docstring).
_PUBLIC_FIELDS = ("ok", "required", "seconds")


def _may_read_details(request: HttpRequest) -> bool:
    """A caller on this machine, or one with the operator's key (the module's docstring)."""
    try:
        if ipaddress.ip_address(str(request.META.get("REMOTE_ADDR", ""))).is_loopback:
            return True
    except ValueError:
        pass
    scheme, _, token = str(request.META.get("HTTP_AUTHORIZATION", "")).strip().partition(" ")
    key = settings.SERVING_WORKER_API_KEY
    return bool(key) and scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


@never_cache
async def readyz(request: HttpRequest) -> JsonResponse:
    """Ready: every required check passes (200), else 503 naming the failing ones."""
    global _last_failing
    status, body = await readiness()
    # Logged when the answer changes, not at every probe (one every few seconds while Redis is away).
    if body["failing"] != _last_failing:
        if body["failing"]:
            logger.warning("not ready: %s", "; ".join(f"{name}: {body['checks'][name]['error']}"
                                                       for name in body["failing"]))
        else:
            logger.info("ready again (was failing: %s)", ", ".join(_last_failing))
        _last_failing = body["failing"]
    if not _may_read_details(request):
        body = {**body, "checks": {name: {field: check[field] for field in _PUBLIC_FIELDS}
                                   for name, check in body["checks"].items()}}
    response = JsonResponse(body, status=status)
    # Django's request log would add an error line per 503 probe; the transitions above say it once.
    setattr(response, "_has_been_logged", True)
    return response
