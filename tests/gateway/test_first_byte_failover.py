"""Issue 37, item 7: a worker that takes a streamed request and sends nothing (frozen, stuck) is
given up on once the first-byte bound passes (GATEWAY_FIRST_BYTE_TIMEOUT): its connection closed (a
live worker then aborts the request), the request failed over to the next worker, and the attempt
counted as the silent worker's failure. A whole reply, whose head comes with its last token, is
given up on the same way once its worker has left the registry (serving.gateway.worker_watch),
never while the worker heartbeats. Against scripted workers on real sockets and the run's Redis;
the bounds are small so the tests wait little, and nothing asserts a duration."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from types import SimpleNamespace

import httpx
import pytest
import redis.asyncio as aioredis

from serving.gateway import pipeline
from serving.gateway.config import GatewayConfig
from serving.gateway.failover import retryable
from serving.gateway.proxy import Upstream
from serving.gateway.records import Call, Caller, Target, TierLimits
from serving.gateway.resilience import worker_failed
from serving.gateway.routing import WorkerView
from serving.gateway.stream_http import FirstByteTimeout, StreamPool
from serving.gateway.worker_watch import unless_worker_gone
from runtime.redis_guard import RedisGuard
from tests.conftest import SLOW_REDIS_S
from serving.contracts.registry import worker_key

TIER = TierLimits(name="standard", requests_per_minute=200, tokens_per_minute=51_200, max_tokens_per_request=256,
                  priority=1, degradation_allowed=True)
WHOLE_BODY = b'{"id":"c","object":"text_completion","choices":[],"usage":{"prompt_tokens":1,"completion_tokens":1}}'
WHOLE = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (
    len(WHOLE_BODY), WHOLE_BODY)
STREAM = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
          b"%x\r\ndata: [DONE]\n\n\r\n0\r\n\r\n" % len(b"data: [DONE]\n\n"))


class Scripted:
    """A worker that reads a request and then answers `reply`, or nothing (None) until the client
    closes the connection, which it notes."""

    def __init__(self, reply: bytes | None) -> None:
        self.reply = reply
        self.requests = 0
        self.closed_by_client = asyncio.Event()

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
        if self.reply is not None:
            writer.write(self.reply)
            await writer.drain()
        if await reader.read() == b"":
            self.closed_by_client.set()
        writer.close()


def test_no_head_within_the_bound_is_a_first_byte_timeout_and_the_connection_is_closed() -> None:
    async def scenario() -> None:
        async with Scripted(None) as silent:
            streams = StreamPool(read_timeout_s=600.0, connect_timeout_s=2.0, idle_s=30.0, max_connections=4)
            with pytest.raises(FirstByteTimeout, match="first-byte bound"):
                await streams.post(f"{silent.url}/v1/completions", b"{}", {}, head_timeout_s=0.2)
            await asyncio.wait_for(silent.closed_by_client.wait(), 30)
            await streams.aclose()

    asyncio.run(scenario())


def test_a_first_byte_timeout_is_retried_elsewhere_a_later_read_timeout_is_not() -> None:
    request = httpx.Request("POST", "http://w/v1/completions")
    assert retryable(status=None, error=FirstByteTimeout("silent", request=request))
    assert not retryable(status=None, error=httpx.ReadTimeout("slow mid-stream", request=request))


def worker(worker_id: str, url: str) -> WorkerView:
    return WorkerView(worker_id=worker_id, url=url, base_model="base", served_model_names=("base",), max_loras=1,
                      max_model_len=2048, queue_depth=0, kv_cache_usage=0.0)


def test_a_silent_worker_is_failed_over_and_counted_as_its_failure() -> None:
    counted: list[tuple[str, bool | None]] = []

    async def scenario() -> None:
        async with Scripted(None) as silent, Scripted(STREAM) as healthy:
            upstream = Upstream(api_key="k", timeout_s=600.0, first_byte_timeout_s=0.2)
            res = SimpleNamespace(
                upstream=upstream, inflight={}, workers=[],
                config=SimpleNamespace(base_model_name="base", gateway=GatewayConfig()),
                resilience=SimpleNamespace(
                    attempt_done=lambda w, result, live: counted.append((w.worker_id, worker_failed(result)))))
            call = Call(endpoint="completions", caller=Caller(tenant_id=1, tenant="t", key_prefix="p", tier=TIER),
                        body={"model": "base", "prompt": "hi", "stream": True}, model="base",
                        target=Target(base=True), max_tokens=4)
            # The frozen one first, the alive one next.
            reply = await pipeline.forward(call, [worker("frozen", silent.url), worker("alive", healthy.url)], res)
            assert reply.status == 200 and reply.stream is not None
            assert (silent.requests, healthy.requests) == (1, 1)
            await asyncio.wait_for(silent.closed_by_client.wait(), 30)
            await upstream.aclose()

    asyncio.run(scenario())
    assert counted == [("frozen", True)]


def test_the_bound_is_a_setting_sized_for_a_prefill_under_load() -> None:
    assert GatewayConfig().first_byte_timeout_s == 30.0
    assert GatewayConfig.from_environ({"GATEWAY_FIRST_BYTE_TIMEOUT": "5"}).first_byte_timeout_s == 5.0


def redis_url() -> str:
    from django.conf import settings

    return settings.REDIS_URL


def test_a_whole_replys_silent_worker_is_failed_over_once_it_left_the_registry(redis_client, monkeypatch) -> None:
    counted: list[tuple[str, bool | None]] = []

    async def no_record(*args: object) -> None:  # the usage record: Redis's business, not this test's
        return None

    monkeypatch.setattr(pipeline, "_record", no_record)

    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_url())
        async with Scripted(None) as silent, Scripted(WHOLE) as healthy:
            # A read timeout of its own, so that without the watch the call ends (502), not the test.
            upstream = Upstream(api_key="k", timeout_s=20.0)
            gateway = GatewayConfig(first_byte_timeout_s=0.2)
            res = SimpleNamespace(
                upstream=upstream, inflight={}, workers=[], redis=client,
                config=SimpleNamespace(base_model_name="base", gateway=gateway),
                resilience=SimpleNamespace(
                    guard=RedisGuard(),
                    attempt_done=lambda w, result, live: counted.append((w.worker_id, worker_failed(result)))))
            call = Call(endpoint="completions", caller=Caller(tenant_id=1, tenant="t", key_prefix="p", tier=TIER),
                        body={"model": "base", "prompt": "hi"}, model="base", target=Target(base=True), max_tokens=4)
            # The frozen one first (no registry entry: its heartbeat stopped), the alive one next.
            reply = await pipeline.forward(call, [worker("frozen", silent.url), worker("alive", healthy.url)], res)
            assert reply.status == 200 and json.loads(reply.body)["object"] == "text_completion"
            assert (silent.requests, healthy.requests) == (1, 1)
            await asyncio.wait_for(silent.closed_by_client.wait(), 30)
            await upstream.aclose()
        await client.aclose()

    asyncio.run(scenario())
    # The frozen one as its failure; the alive one's answer, settled, as its success.
    assert counted == [("frozen", True), ("alive", False)]


def test_a_whole_reply_waits_while_its_worker_heartbeats_and_not_for_another_instance(redis_client) -> None:
    async def scenario() -> None:
        client = aioredis.Redis.from_url(redis_url())
        guard, view = RedisGuard(timeout_s=SLOW_REDIS_S), replace(worker("w1", "http://127.0.0.1:1"), started_at=5.0)
        await client.set(worker_key("w1"), json.dumps({"worker_id": "w1", "started_at": 5.0}), ex=60)
        reads = 0
        real_get = client.get

        async def counting_get(key: str) -> object:
            nonlocal reads
            reads += 1
            return await real_get(key)

        client.get = counting_get  # type: ignore[method-assign]
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[str] = loop.create_future()
        watched = asyncio.ensure_future(unless_worker_gone(answer, worker=view, redis=client, guard=guard,
                                                           first_check_s=0.01, every_s=0.01))
        while reads < 3:  # looked up three times, still there: the call goes on
            await asyncio.sleep(0.01)
        assert not watched.done()
        answer.set_result("the reply")
        assert await watched == "the reply"
        # Restarted (another instance): the request is lost with the old one.
        await client.set(worker_key("w1"), json.dumps({"worker_id": "w1", "started_at": 6.0}), ex=60)
        pending: asyncio.Future[str] = loop.create_future()
        with pytest.raises(FirstByteTimeout, match="left the registry"):
            await unless_worker_gone(pending, worker=view, redis=client, guard=guard, first_check_s=0.01)
        assert pending.cancelled()
        await client.aclose()

    asyncio.run(scenario())
