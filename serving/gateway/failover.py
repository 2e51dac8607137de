"""Failover: a request that fails before its first byte is retried once, on the next-best worker.

- Retried: the worker could not be reached or dropped the connection before answering (refused,
  reset, closed mid-headers: it died), it answered 5xx, or it refused the gateway's operator key
  (401/403: the worker is keyed differently, a misconfiguration of that worker, not of the
  request). Nothing of the reply has reached the client yet, so another worker can serve it whole.
- Retried too: a stream whose worker sent no response head (it sends it with the first token)
  within the first-byte bound (GATEWAY_FIRST_BYTE_TIMEOUT, FirstByteTimeout): the worker took the
  request and is frozen or stuck; the call's connection is closed, so a worker still alive aborts
  it, and the attempt counts as that worker's failure.
- Not retried: a read timeout after the head (the worker may still be generating: a second copy
  would double the load exactly when a worker is slow), a 4xx (the request itself is wrong; another worker would
  say the same), and anything after the first byte (a stream already under way ends with an
  error event instead; serving.gateway.proxy).
- At most two attempts, on two different workers: the next-best in the ranking, never the same
  worker twice.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import httpx

from serving.gateway.stream_http import FirstByteTimeout

MAX_ATTEMPTS = 2

# Failures that happen before any reply: the request never ran or its reply is lost.
_RETRYABLE_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError,
                     httpx.WriteError, httpx.PoolTimeout, FirstByteTimeout)


class HasWorkerId(Protocol):
    @property
    def worker_id(self) -> str: ...


W = TypeVar("W", bound=HasWorkerId)
T = TypeVar("T")


def key_refused(status: int | None) -> bool:
    """Whether a worker's answer says it refused the gateway's operator key. The gateway sends
    the one key every worker must share, so this is the worker's configuration (another key, or
    none where an operator-only field needs one), never the client's key, which the gateway
    checked itself."""
    return status in (401, 403)


def retryable(*, status: int | None, error: BaseException | None) -> bool:
    """Whether an attempt that ended before its first byte may be tried on another worker."""
    if error is not None:
        return isinstance(error, _RETRYABLE_ERRORS)
    return status is not None and (status >= 500 or key_refused(status))


def ranked(scored: Sequence[tuple[float, W]], *, rng: random.Random | None = None) -> list[W]:
    """Workers best first (ties in random order), each worker once."""
    draw = (rng or random).random
    order = sorted(scored, key=lambda item: (-item[0], draw()))
    seen: set[str] = set()
    workers = []
    for _, worker in order:
        if worker.worker_id not in seen:
            seen.add(worker.worker_id)
            workers.append(worker)
    return workers


@dataclass
class Tried(Generic[W, T]):
    """One attempt: the worker and what `attempt` returned for it."""

    worker: W
    result: T


async def with_failover(workers: Sequence[W], attempt: Callable[[W], Awaitable[T]],
                        should_retry: Callable[[T], bool],
                        on_retry: Callable[[W, T], None] | None = None) -> list[Tried[W, T]]:
    """Runs `attempt` on the best worker and, if `should_retry` says so and another worker is
    there, once more on the next one; `on_retry` hears of each attempt given up for the next, before
    that one starts (the pipeline counts it on its worker's record and leaves its in-flight count).

    Returns every attempt in order (the last one is the answer, whatever `should_retry` says of it)."""
    tried: list[Tried[W, T]] = []
    chances = workers[:MAX_ATTEMPTS]
    for index, worker in enumerate(chances):
        result = await attempt(worker)
        tried.append(Tried(worker=worker, result=result))
        if index + 1 == len(chances) or not should_retry(result):
            break
        if on_retry is not None:
            on_retry(worker, result)
    return tried
