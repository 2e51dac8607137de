"""Helpers for the resilience suites: an injected clock, Redis URLs, a TCP relay to cut Redis off."""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import parse_qs, urlparse


class Clock:
    """A clock the test moves by hand (resilience4j's tests inject theirs the same way)."""

    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def dead_redis_url() -> str:
    """A Redis URL where nothing listens: connecting is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"


class RedisRelay:
    """A TCP relay in front of a real Redis, so a test can cut Redis off and bring it back.

    `cut()` closes every relayed connection and refuses new ones (what a client sees when Redis
    dies); `restore()` accepts again. Runs on its own thread with its own event loop.
    """

    def __init__(self, redis_url: str) -> None:
        self._target = urlparse(redis_url)
        self.db = int(parse_qs(self._target.query).get("db", [0])[0]) if self._target.scheme == "unix" \
            else int((self._target.path or "/0").strip("/") or 0)
        self._loop = asyncio.new_event_loop()
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.base_events.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self._thread.start()
        self.restore()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/{self.db}"

    async def _open_upstream(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self._target.scheme == "unix":
            return await asyncio.open_unix_connection(self._target.path)
        return await asyncio.open_connection(self._target.hostname or "127.0.0.1", self._target.port or 6379)

    def _call(self, coro) -> None:
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=5)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await self._open_upstream()
        except OSError:
            writer.close()
            return
        self._writers.update((writer, up_writer))
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        self._writers.difference_update((writer, up_writer))

    async def _start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port, reuse_address=True)

    async def _stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.close()
        self._writers.clear()

    def cut(self) -> None:
        self._call(self._stop())

    def restore(self) -> None:
        self._call(self._start())

    def close(self) -> None:
        self.cut()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()


@contextmanager
def redis_relay(redis_url: str) -> Iterator[RedisRelay]:
    """A relay to the Redis at `redis_url` (TCP or unix socket), listening on a TCP port of its own."""
    relay = RedisRelay(redis_url)
    try:
        yield relay
    finally:
        relay.close()
