"""The gateway's HTTP/1.1 client for streamed calls (serving.gateway.stream_http), against a scripted
server on a real socket, on asyncio's loop and on uvloop (production's): the request as sent,
chunked bodies cut anywhere, keep-alive reuse and when a connection is dropped instead, and each
failure as the httpx exception the failover rules and the relay judge."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import httpx
import pytest
import uvloop

from serving.gateway.stream_http import StreamPool

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Callable[[Coroutine[Any, Any, Any]], Any]:
    factory = uvloop.new_event_loop if request.param == "uvloop" else asyncio.new_event_loop

    def runner(coro: Coroutine[Any, Any, Any]) -> Any:
        with asyncio.Runner(loop_factory=factory) as r:
            return r.run(coro)

    return runner


class Worker:
    """A server running `handler` once per request; counts its connections and keeps what it read."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed_by_client = asyncio.Event()

    async def __aenter__(self) -> Worker:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1/completions"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    self.closed_by_client.set()
                    return
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length")))
                self.requests.append(head + await reader.readexactly(length))
                await self.handler(reader, writer)
                if writer.is_closing():
                    return
        finally:
            writer.close()


def chunked(*events: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(event), event) for event in events) + b"0\r\n\r\n"


def pool(**overrides: float) -> StreamPool:
    settings: dict[str, Any] = dict(read_timeout_s=5.0, connect_timeout_s=2.0, idle_s=30.0, max_connections=10)
    return StreamPool(**{**settings, **overrides})


async def body_of(streams: StreamPool, url: str, payload: bytes = b'{"stream":true}') -> tuple[int, list[bytes]]:
    response = await streams.post(url, payload, {"Authorization": "Bearer k", "X-Request-ID": "req-1"})
    reads = []
    while data := await response.read():
        reads.append(data)
    await response.aclose()
    return response.status_code, reads


def test_the_request_goes_out_as_http_1_1_with_its_headers_and_json_body(run) -> None:
    async def scenario() -> bytes:
        async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")

        async with Worker(reply) as worker:
            status, reads = await body_of(pool(), worker.url, b'{"model":"m"}')
            assert (status, b"".join(reads)) == (200, b"{}")
            return worker.requests[0]

    request = run(scenario())
    head, _, body = request.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /v1/completions HTTP/1.1"
    assert {b"Host: 127.0.0.1:" + lines[1].split(b":")[2], b"Content-Type: application/json", b"Content-Length: 13",
            b"Authorization: Bearer k", b"X-Request-ID: req-1"} == set(lines[1:])
    assert body == b'{"model":"m"}'


def test_a_chunked_stream_cut_anywhere_is_read_whole_and_its_connection_serves_the_next_call(run) -> None:
    events = [b"data: {\"a\":1}\n\n", b"data: {\"b\":2}\n\n", b"data: [DONE]\n\n"]
    wire = HEAD + chunked(*events)

    async def scenario() -> None:
        async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            for cut in range(0, len(wire), 7):  # chunk-size lines, CRLFs and data split across writes
                writer.write(wire[cut:cut + 7])
                await writer.drain()
                await asyncio.sleep(0.001)

        async with Worker(reply) as worker:
            streams = pool()
            for _ in range(2):
                status, reads = await body_of(streams, worker.url)
                assert status == 200 and b"".join(reads) == b"".join(events)
                assert len(reads) > 3, "bytes go out as they arrive, not at the end"
            assert worker.connections == 1

    run(scenario())


def test_the_events_of_one_network_read_come_in_one_read(run) -> None:
    async def scenario() -> None:
        async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(HEAD)
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.write(chunked(b"one\n\n", b"two\n\n", b"three\n\n"))

        async with Worker(reply) as worker:
            _, reads = await body_of(pool(), worker.url)
            assert reads == [b"one\n\ntwo\n\nthree\n\n"]

    run(scenario())


def test_a_reply_closing_its_connection_or_left_unread_does_not_give_it_to_the_next_call(run) -> None:
    async def scenario() -> None:
        async def closing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"HTTP/1.1 503 Service Unavailable\r\nconnection: close\r\ncontent-length: 4\r\n\r\nbusy")
            await writer.drain()
            writer.close()

        async with Worker(closing) as worker:
            streams = pool()
            for _ in range(2):
                response = await streams.post(worker.url, b"{}", {})
                assert (response.status_code, await response.aread()) == (503, b"busy")
                await response.aclose()
            assert worker.connections == 2

        async def unframed(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"HTTP/1.1 200 OK\r\n\r\nall of it")  # no length, not chunked: until closed
            await writer.drain()
            writer.close()

        async with Worker(unframed) as worker:
            streams = pool()
            for _ in range(2):
                response = await streams.post(worker.url, b"{}", {})
                assert await response.aread() == b"all of it"
            assert worker.connections == 2

        async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(HEAD + b"6\r\ndata: \r\n")
            await writer.drain()
            await reader.read()  # until the gateway closes: the worker aborts the request

        async with Worker(endless) as worker:
            streams = pool()
            response = await streams.post(worker.url, b"{}", {})
            assert await response.read() == b"data: "
            await response.aclose()
            await asyncio.wait_for(worker.closed_by_client.wait(), 2)
            response = await streams.post(worker.url, b"{}", {})
            await response.aclose()
            assert worker.connections == 2

    run(scenario())


def test_an_idle_connection_past_its_time_is_dropped_for_a_new_one(run) -> None:
    async def scenario() -> None:
        async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(HEAD + chunked(b"x"))

        async with Worker(reply) as worker:
            streams = pool(idle_s=0.05)
            await body_of(streams, worker.url)
            await asyncio.sleep(0.1)
            await body_of(streams, worker.url)
            assert worker.connections == 2

    run(scenario())


def test_failures_are_the_httpx_errors_failover_and_the_relay_judge(run) -> None:
    async def scenario() -> None:
        async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.close()

        async with Worker(hang_up) as worker:
            with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
                await pool().post(worker.url, b"{}", {})

        async def cut_mid_body(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(HEAD + b"5\r\nhello\r\n")
            await writer.drain()
            writer.close()

        async with Worker(cut_mid_body) as worker:
            response = await pool().post(worker.url, b"{}", {})
            assert await response.read() == b"hello"
            with pytest.raises(httpx.RemoteProtocolError, match="before the end"):
                await response.read()

        async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(HEAD + b"5\r\nhello\r\n")
            await writer.drain()
            writer.transport.abort()  # type: ignore[attr-defined]

        async with Worker(reset) as worker:
            response = await pool().post(worker.url, b"{}", {})
            with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
                while await response.read():
                    pass

        async def garbled(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(HEAD + b"zz\r\nhello\r\n")

        async with Worker(garbled) as worker:
            response = await pool().post(worker.url, b"{}", {})
            with pytest.raises(httpx.RemoteProtocolError, match="chunk size"):
                await response.read()

        async def not_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")

        async with Worker(not_http) as worker:
            with pytest.raises(httpx.RemoteProtocolError, match="not HTTP"):
                await pool().post(worker.url, b"{}", {})

        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        with pytest.raises(httpx.ConnectError):
            await pool().post(f"http://127.0.0.1:{port}/v1/completions", b"{}", {})
        with pytest.raises(httpx.LocalProtocolError):
            await pool().post(f"http://127.0.0.1:{port}/v1/completions", b"{}", {"X-Request-ID": "a\r\nHost: b"})

    run(scenario())


def test_the_read_timeout_is_per_quiet_spell_not_per_reply(run) -> None:
    async def scenario() -> None:
        async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(HEAD)
            for _ in range(6):  # 0.36 s in all, never 0.2 s without a byte
                await asyncio.sleep(0.06)
                writer.write(chunked(b"t")[:-5])
                await writer.drain()
            writer.write(b"0\r\n\r\n")

        async with Worker(trickle) as worker:
            _, reads = await body_of(pool(read_timeout_s=0.2), worker.url)
            assert b"".join(reads) == b"t" * 6

        async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(HEAD + b"1\r\nt\r\n")
            await writer.drain()
            await asyncio.sleep(1)

        async with Worker(stall) as worker:
            response = await pool(read_timeout_s=0.2).post(worker.url, b"{}", {})
            assert await response.read() == b"t"
            started = asyncio.get_running_loop().time()
            with pytest.raises(httpx.ReadTimeout):
                await response.read()
            assert 0.15 < asyncio.get_running_loop().time() - started < 0.6
            await response.aclose()

    run(scenario())


def test_a_consumer_slower_than_the_timeout_is_no_timeout_and_calls_past_the_cap_wait_then_give_up(run) -> None:
    async def scenario() -> None:
        async def two_parts(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(HEAD + b"1\r\na\r\n")
            await writer.drain()
            await asyncio.sleep(0.3)
            writer.write(b"1\r\nb\r\n0\r\n\r\n")

        async with Worker(two_parts) as worker:
            # The timeout counts while waiting for bytes, not while the caller is busy elsewhere.
            response = await pool(read_timeout_s=0.2).post(worker.url, b"{}", {})
            assert await response.read() == b"a"
            await asyncio.sleep(0.25)
            assert await response.read() == b"b"

            streams = pool(read_timeout_s=0.2, max_connections=1)
            first = await streams.post(worker.url, b"{}", {})
            with pytest.raises(httpx.PoolTimeout):
                await streams.post(worker.url, b"{}", {})
            await first.aclose()  # its slot back: the next call goes ahead
            second = await streams.post(worker.url, b"{}", {})
            assert await second.read() == b"a"
            await second.aclose()

    run(scenario())


def test_chunk_extensions_and_trailers_are_skipped_and_a_negative_size_is_malformed(run) -> None:
    async def scenario() -> None:
        async def extended(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(HEAD + b"5;note=x\r\nhello\r\n0\r\nx-trailer: 1\r\n\r\n")

        async with Worker(extended) as worker:
            streams = pool()
            assert (await body_of(streams, worker.url))[1] == [b"hello"]
            await body_of(streams, worker.url)
            assert worker.connections == 1, "the trailers were read to the end: the connection is reused"

        async def negative(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.write(HEAD + b"-1\r\nhello\r\n")

        async with Worker(negative) as worker:
            response = await pool().post(worker.url, b"{}", {})
            with pytest.raises(httpx.RemoteProtocolError, match="chunk size"):
                await response.read()

    run(scenario())
