"""Issue 37, item 1 (the gateway's half): no 4xx and no caller-caused error counts toward a
worker's outlier ejection or an adapter's breaker. Through the pipeline's forward step against a
scripted worker on a real socket: a worker's 400 counts neither way; a request the gateway cannot
encode (NaN that got past the checks) is a 400 the worker never sees, counted neither way (it was a
500 counted as the worker's failure); the gateway's own failure is not the worker's either."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from serving.gateway import pipeline
from serving.gateway.config import GatewayConfig
from serving.gateway.errors import GatewayError
from serving.gateway.proxy import Upstream, UpstreamResult
from serving.gateway.records import Call, Caller, Target, TierLimits
from serving.gateway.resilience import breaker_outcome, worker_failed
from serving.gateway.routing import WorkerView
from runtime.breakers import Outcome

TIER = TierLimits(name="standard", requests_per_minute=200, tokens_per_minute=51_200, max_tokens_per_request=256,
                  priority=1, degradation_allowed=True)
REFUSAL = json.dumps({"error": {"message": "bad", "type": "invalid_request_error", "param": "n",
                                "code": "invalid_request"}}).encode()
BAD_REQUEST = b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
    len(REFUSAL), REFUSAL)


class Scripted:
    """A worker that answers every request with `reply`; counts the requests it read."""

    def __init__(self, reply: bytes) -> None:
        self.reply = reply
        self.requests = 0

    async def __aenter__(self) -> Scripted:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        await reader.readexactly(length)
        self.requests += 1
        writer.write(self.reply)
        await writer.drain()
        writer.close()


def forwarding(body: dict, upstream_of, monkeypatch: pytest.MonkeyPatch) -> tuple[object, list[UpstreamResult], int]:
    """(what forward returned or raised, the results counted on the worker's record, the worker's requests)."""
    counted: list[UpstreamResult] = []

    async def no_record(*args: object) -> None:  # the usage record and refund: Redis's business, not this test's
        return None

    monkeypatch.setattr(pipeline, "_record", no_record)

    async def scenario() -> tuple[object, int]:
        async with Scripted(BAD_REQUEST) as worker:
            upstream = upstream_of()
            res = SimpleNamespace(
                upstream=upstream, inflight={}, workers=[], redis=None,  # the worker watch: never reached
                config=SimpleNamespace(base_model_name="base", gateway=GatewayConfig()),
                resilience=SimpleNamespace(guard=None, attempt_done=lambda w, result, live: counted.append(result)))
            call = Call(endpoint="completions", caller=Caller(tenant_id=1, tenant="t", key_prefix="p", tier=TIER),
                        body=body, model="base", target=Target(base=True), max_tokens=4)
            only = WorkerView(worker_id="w1", url=worker.url, base_model="base", served_model_names=("base",),
                              max_loras=1, max_model_len=2048, queue_depth=0, kv_cache_usage=0.0)
            try:
                outcome: object = await pipeline.forward(call, [only], res)
            except Exception as exc:
                outcome = exc
            finally:
                await upstream.aclose()
            return outcome, worker.requests

    outcome, requests = asyncio.run(scenario())
    return outcome, counted, requests


def real_upstream() -> Upstream:
    return Upstream(api_key="k", timeout_s=30.0)


def test_a_workers_400_counts_neither_on_the_worker_nor_on_the_breaker(monkeypatch) -> None:
    reply, counted, requests = forwarding({"model": "base", "prompt": "hi", "n": 1}, real_upstream, monkeypatch)
    assert requests == 1 and reply.status == 400 and json.loads(reply.body)["error"]["code"] == "invalid_request"
    assert [(worker_failed(result), breaker_outcome(result)) for result in counted] == [(None, Outcome.IGNORED)]


def test_a_request_the_gateway_cannot_encode_is_a_400_counted_neither_way(monkeypatch) -> None:
    refused, counted, requests = forwarding({"model": "base", "prompt": "hi", "temperature": float("nan")},
                                            real_upstream, monkeypatch)
    assert requests == 0, "the worker never saw it"
    assert isinstance(refused, GatewayError) and (refused.status, refused.code) == (400, "invalid_json")
    assert [(worker_failed(result), breaker_outcome(result)) for result in counted] == [(None, Outcome.IGNORED)]


def test_the_gateways_own_failure_is_not_the_workers(monkeypatch) -> None:
    class Broken(Upstream):
        async def call(self, *args: object, **kwargs: object) -> bytes:
            raise RuntimeError("a bug of the gateway's")

    failed, counted, _ = forwarding({"model": "base", "prompt": "hi"}, lambda: Broken(api_key="k", timeout_s=30.0),
                                    monkeypatch)
    assert isinstance(failed, RuntimeError)
    assert [(worker_failed(result), breaker_outcome(result)) for result in counted] == [(None, Outcome.IGNORED)]
