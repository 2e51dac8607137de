"""Issue 37, item 7: a worker that takes a streamed request and sends nothing (frozen, stuck) is
given up on once the first-byte bound passes (GATEWAY_FIRST_BYTE_TIMEOUT): its connection closed (a
live worker then aborts the request), the request failed over to the next worker, and the attempt
counted as the silent worker's failure. Against scripted workers on real sockets; the bound is
small so the test waits little, and nothing asserts a duration."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import pytest

from serving.gateway import pipeline
from serving.gateway.config import GatewayConfig
from serving.gateway.failover import retryable
from serving.gateway.proxy import Upstream
from serving.gateway.records import Call, Caller, Target, TierLimits
from serving.gateway.resilience import worker_failed
from serving.gateway.routing import WorkerView
from serving.gateway.stream_http import FirstByteTimeout, StreamPool

TIER = TierLimits(name="standard", requests_per_minute=200, tokens_per_minute=51_200, max_tokens_per_request=256,
                  priority=1, degradation_allowed=True)
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
            call.worker = worker("frozen", silent.url)
            call.fallbacks = [worker("alive", healthy.url)]
            reply = await pipeline.forward(call, res)
            assert reply.status == 200 and reply.stream is not None
            assert call.worker.worker_id == "alive" and (silent.requests, healthy.requests) == (1, 1)
            await asyncio.wait_for(silent.closed_by_client.wait(), 30)
            await upstream.aclose()

    asyncio.run(scenario())
    assert counted == [("frozen", True)]


def test_the_bound_is_a_setting_sized_for_a_prefill_under_load() -> None:
    assert GatewayConfig().first_byte_timeout_s == 30.0
    assert GatewayConfig.from_environ({"GATEWAY_FIRST_BYTE_TIMEOUT": "5"}).first_byte_timeout_s == 5.0
