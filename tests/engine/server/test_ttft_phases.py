"""The worker's TTFT breakdown (loraplex_request_{admission,queue,prefill,first_token_delivery}_seconds,
serving.engine.server.metrics): every request that gets a first token observes each phase once,
beside its TTFT; no phase is empty or negative; and a request's phases add up to no more than the
TTFT observed for it. With the engine on a thread of the worker, and in a process of its own
(--engine-process), where admission and delivery span two processes and the engine's times cross
the pipe with the request's first output.

A request's own figures are the /metrics deltas around it, sent alone. No tolerance on the sum:
each clock pair is read in the order that leaves the gap between its two reads outside the phases
(serving.engine.outputs.FirstTokenTimes), so the phases' sum is below the TTFT by those gaps.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.engine.server.conftest import WorkerProcess

BASE = "tiny-base"
TTFT = "loraplex_time_to_first_token_seconds"
PHASES = ("loraplex_request_admission_seconds", "loraplex_request_queue_seconds",
          "loraplex_request_prefill_seconds", "loraplex_request_first_token_delivery_seconds")
HISTOGRAMS = (TTFT, *PHASES)
PROMPT = [1, 45, 99, 173, 201, 32]  # token ids


@pytest.fixture(scope="module", params=["--no-engine-process", "--engine-process"])
def served(request: pytest.FixtureRequest, start_worker: Callable[..., WorkerProcess]) -> WorkerProcess:
    return start_worker(request.param, "--served-model-name", BASE)


def histograms(url: str) -> dict[str, tuple[float, float]]:
    """Each histogram's (sum, count) on the worker's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    samples = {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}
    return {name: (samples[f"{name}_sum"], samples[f"{name}_count"]) for name in HISTOGRAMS}


def delta(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
          ) -> dict[str, tuple[float, float]]:
    return {name: (after[name][0] - before[name][0], after[name][1] - before[name][1]) for name in HISTOGRAMS}


def complete(url: str, body: dict[str, Any], path: str = "/v1/completions") -> None:
    """One request to its end, its stream read whole."""
    if not body.get("stream"):
        response = httpx.post(f"{url}{path}", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=120) as response:
        assert response.status_code == 200
        assert [line for line in response.iter_lines() if line][-1] == "data: [DONE]"


REQUESTS = {
    "streamed": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "stream": True}),
    "whole": ("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 3}),
    # Two engine requests, one HTTP request: one TTFT, the phases of the prompt that gave it.
    "two prompts": ("/v1/completions", {"prompt": [PROMPT, PROMPT[:3]], "max_tokens": 3, "stream": True}),
    # Two completions forked from one prefill.
    "n=2": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "n": 2, "temperature": 1.0, "seed": 3}),
    # Its first output is its last (the best two of three are chosen once all have ended).
    "best_of": ("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "n": 2, "best_of": 3, "temperature": 1.0}),
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
                                      "stream": True}),
}


@pytest.mark.parametrize("kind", list(REQUESTS))
def test_a_request_observes_each_phase_once_and_they_add_up_to_at_most_its_ttft(served: WorkerProcess,
                                                                                 kind: str) -> None:
    path, body = REQUESTS[kind]
    before = histograms(served.url)
    complete(served.url, {"model": BASE, "ignore_eos": True, **body}, path)
    observed = delta(before, histograms(served.url))
    assert {name: count for name, (_, count) in observed.items()} == dict.fromkeys(HISTOGRAMS, 1.0)
    phases = {name: observed[name][0] for name in PHASES}
    # Every phase takes time: a phase whose two ends were the same reading (or swapped) would not.
    assert all(seconds > 0 for seconds in phases.values()), phases
    assert sum(phases.values()) <= observed[TTFT][0], (phases, observed[TTFT][0])


def test_concurrent_requests_observe_once_each_and_a_refused_one_not_at_all(served: WorkerProcess) -> None:
    body = {"model": BASE, "prompt": PROMPT, "max_tokens": 6, "ignore_eos": True, "stream": True}
    before = histograms(served.url)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: complete(served.url, {**body, "prompt": PROMPT[: 1 + i % len(PROMPT)]}), range(8)))
    refused = httpx.post(f"{served.url}/v1/completions", json={**body, "max_tokens": 4096}, timeout=60)
    assert refused.status_code == 400
    observed = delta(before, histograms(served.url))
    assert {name: count for name, (_, count) in observed.items()} == dict.fromkeys(HISTOGRAMS, 8.0)
    # Each request's phases add up to at most its TTFT, so their sums over the requests do too.
    assert sum(observed[name][0] for name in PHASES) <= observed[TTFT][0]
