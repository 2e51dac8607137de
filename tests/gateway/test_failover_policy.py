"""Failover policy: retried once before the first byte, on the next-best worker, never twice on one."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import httpx

from serving.gateway.failover import ranked, retryable, with_failover


@dataclass(frozen=True)
class W:
    worker_id: str


def test_ranking_is_best_first_each_worker_once_ties_random() -> None:
    a, b, c = W("a"), W("b"), W("c")
    assert ranked([(0.1, a), (0.9, b), (0.5, c), (0.2, b)]) == [b, c, a]
    firsts = {ranked([(1.0, a), (1.0, b)], rng=random.Random(seed))[0].worker_id for seed in range(20)}
    assert firsts == {"a", "b"}


def test_what_is_retried() -> None:
    request = httpx.Request("POST", "http://w/v1/completions")
    assert retryable(status=None, error=httpx.ConnectError("refused", request=request))
    assert retryable(status=None, error=httpx.RemoteProtocolError("closed", request=request))
    assert retryable(status=None, error=httpx.ReadError("reset", request=request))
    assert not retryable(status=None, error=httpx.ReadTimeout("slow", request=request))
    assert retryable(status=502, error=None) and retryable(status=503, error=None)
    assert not retryable(status=400, error=None) and not retryable(status=200, error=None)
    # A worker refusing the gateway's operator key is misconfigured; another worker may accept it.
    assert retryable(status=401, error=None) and retryable(status=403, error=None)
    assert not retryable(status=404, error=None) and not retryable(status=429, error=None)


def test_one_retry_on_the_next_worker_then_the_answer_stands() -> None:
    workers = [W("a"), W("b"), W("c")]
    calls: list[str] = []

    async def attempt(worker: W) -> int:
        calls.append(worker.worker_id)
        return 503

    tried = asyncio.run(with_failover(workers, attempt, lambda status: status >= 500))
    assert calls == ["a", "b"] and [t.result for t in tried] == [503, 503]


def test_no_retry_after_success_or_with_one_worker() -> None:
    async def ok(worker: W) -> int:
        return 200

    async def down(worker: W) -> int:
        return 502

    assert [t.worker.worker_id for t in asyncio.run(with_failover([W("a"), W("b")], ok, lambda s: s >= 500))] == ["a"]
    assert [t.worker.worker_id for t in asyncio.run(with_failover([W("a")], down, lambda s: s >= 500))] == ["a"]


def test_the_attempt_given_up_is_handed_to_on_retry_before_the_next_starts_and_the_answer_never_is() -> None:
    # The pipeline leaves the given-up worker's in-flight count and counts its failure there: the
    # next attempt must see it done, and the attempt that answers (settled instead) must not be.
    events: list[str] = []

    async def attempt(worker: W) -> int:
        events.append(f"attempt {worker.worker_id}")
        return 503

    def given_up(worker: W, status: int) -> None:
        events.append(f"given up {worker.worker_id} ({status})")

    asyncio.run(with_failover([W("a"), W("b"), W("c")], attempt, lambda s: s >= 500, on_retry=given_up))
    assert events == ["attempt a", "given up a (503)", "attempt b"]
    events.clear()
    asyncio.run(with_failover([W("a")], attempt, lambda s: s >= 500, on_retry=given_up))
    assert events == ["attempt a"]  # no next worker: the failure is the answer
