"""The gateway's HTTP/1.1 client for the calls it relays to the serving workers (issue 22, item 4).

Relaying a token through httpx's streaming iterator cost the web process, per network read, an
anyio cancel scope with its timer, httpcore's and h11's event machinery and four layers of async
iterators (docs/benchmarks.md, "The gateway's CPU per relayed token"). A worker's reply is one
known shape, an HTTP/1.1 response (chunked while it streams), so this reads it with one asyncio
protocol per connection: what the network brings is de-chunked and handed over in one piece per
wake-up (`StreamResponse.read`), and one idle timer per response, pushed back lazily, stands for
the read timeout of every read.

Failures keep httpx's exception classes, which serving.gateway.failover and the relay already
judge: ConnectError / ConnectTimeout (no connection), RemoteProtocolError (the worker closed the
connection before its reply or inside it, or sent something that is not HTTP/1.1), ReadError (the
connection was reset), ReadTimeout (no byte for the read timeout; its subclass FirstByteTimeout
when a call's own bound on the response head passed: the gateway fails over on that one), PoolTimeout (`max_connections`
calls in flight for the pool timeout), LocalProtocolError (a header value that would split the
request).

Connections are kept alive per worker and reused newest first; one idle past `idle_s` (shorter than
the worker's keep-alive, serving.contracts.registry), closed by the worker, or holding bytes nobody
asked for is dropped at the next checkout. A response left before its end (the client left, or the
relay failed) closes its connection, which the worker takes for the request aborted.
"""

from __future__ import annotations

import asyncio
import ssl
from dataclasses import dataclass
from functools import lru_cache
from typing import cast
from urllib.parse import urlsplit

import httpx

# Past this many unread bytes the connection stops reading (httpx read 64 KiB at a time, on
# demand), so a slow client slows the worker's socket, not the gateway's memory.
_HIGH_WATER = 64 * 1024
_MAX_HEAD = 64 * 1024
_MAX_CHUNK_LINE = 1024
# Chunked-body states besides "bytes left in the current chunk" (> 0).
_SIZE_LINE, _CHUNK_END, _TRAILERS = -1, -2, -3


class FirstByteTimeout(httpx.ReadTimeout):
    """The worker sent no response head within the call's first-byte bound: it took the request
    and answers nothing (frozen, or stuck), and the connection is closed, which aborts the request
    on a worker still alive; another worker may serve it (serving.gateway.failover)."""


@dataclass(frozen=True)
class _Target:
    host: str
    port: int
    tls: bool
    # The request's first line and Host header, up to the headers that vary per call.
    head: bytes


@lru_cache(maxsize=1024)
def _target(url: str) -> _Target:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise httpx.UnsupportedProtocol(f"Request URL {url!r} is not an http(s) URL.")
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return _Target(host=parts.hostname, port=port, tls=tls,
                   head=f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n".encode("ascii"))


class _Connection(asyncio.Protocol):
    """One connection: bytes received and not yet read, and one waiter for more."""

    def __init__(self, loop: asyncio.AbstractEventLoop, key: tuple[str, int, bool]) -> None:
        self.loop = loop
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.closed = False  # by either side
        self.eof = False  # the worker will send nothing more
        self.lost: Exception | None = None  # what closed it, when it was not a clean close
        self.paused = False
        self.idle_since = 0.0
        # The read timeout: when the current wait for bytes began, and one timer.
        self.timeout_s = 0.0
        self.waiting_since = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._waiter: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A TCP transport (uvloop's is no subclass of asyncio.Transport, hence the cast).
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if len(self.buffer) > _HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self.eof = True
        self._wake()
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.lost = exc
        self._disarm()
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self, timeout_s: float) -> None:
        """Until more bytes, the end of the connection, or `timeout_s` without a byte (ReadTimeout)."""
        if self.closed or self.eof:
            return
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        self._waiter = waiter = self.loop.create_future()
        self.timeout_s = timeout_s
        self.waiting_since = self.loop.time()
        if self._timer is None:
            self._timer = self.loop.call_at(self.waiting_since + timeout_s, self._timed_out)
        await waiter

    def _timed_out(self) -> None:
        # One timer for a reply's many waits: one that ends before it fires leaves it armed, and it
        # moves on to the deadline of the wait under way, if any.
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        deadline = self.waiting_since + self.timeout_s
        if self.loop.time() < deadline:
            self._timer = self.loop.call_at(deadline, self._timed_out)
            return
        self._waiter = None
        waiter.set_exception(httpx.ReadTimeout(f"No byte from the worker in {self.timeout_s:g} s."))

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def clean(self) -> bool:
        """Open, with nothing unread: fit for another request."""
        return not (self.closed or self.eof or self.buffer)

    def parked(self) -> None:
        self._disarm()
        self.idle_since = self.loop.time()

    def close(self) -> None:
        self._disarm()
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True

    def failure(self, *, in_body: bool) -> httpx.TransportError:
        """What the end of the connection means to a call still reading from it."""
        if isinstance(self.lost, OSError) and not isinstance(self.lost, ssl.SSLError):
            return httpx.ReadError(str(self.lost) or type(self.lost).__name__)
        if in_body:
            return httpx.RemoteProtocolError("The worker closed the connection before the end of its reply.")
        return httpx.RemoteProtocolError("Server disconnected without sending a response.")


class StreamResponse:
    """A worker's reply: its status and headers read, its body read with `read` as it arrives."""

    def __init__(self, pool: StreamPool, conn: _Connection, status_code: int, headers: dict[bytes, bytes],
                 keep_alive: bool) -> None:
        self._pool = pool
        self._conn: _Connection | None = conn
        self.status_code = status_code
        self.headers = headers
        self._keep_alive = keep_alive
        self._complete = False
        encoding = headers.get(b"transfer-encoding", b"").lower()
        length = headers.get(b"content-length")
        # Bytes left of the current chunk (chunked; or a state below 0) or of the body (a length);
        # with neither, the body ends when the worker closes the connection.
        self._chunked = b"chunked" in encoding
        self._until_close = False
        if status_code in (204, 304):
            self._complete = True
            self._left = 0
        elif self._chunked:
            self._left = _SIZE_LINE
        elif length is not None:
            try:
                self._left = int(length)
            except ValueError:
                conn.close()
                raise httpx.RemoteProtocolError(f"Malformed Content-Length {length!r}.") from None
            self._complete = self._left == 0
        else:
            self._left = 0
            self._until_close = True
            self._keep_alive = False
        if self._complete:
            self._release()

    async def read(self) -> bytes:
        """The body's bytes that arrived since the last call (waiting for at least one), b"" once
        the body has ended."""
        while True:
            conn = self._conn
            if conn is None:
                return b""
            data = self._take(conn)
            if self._complete:
                self._release()
                return data
            if data:
                return data
            if conn.closed or conn.eof:
                if self._until_close:
                    self._complete = True
                    self._release()
                    return b""
                self.close()
                raise conn.failure(in_body=True)
            await conn.wait(self._pool.read_timeout_s)

    async def aread(self) -> bytes:
        """The whole body."""
        parts = []
        while data := await self.read():
            parts.append(data)
        return b"".join(parts)

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Done with the reply: its connection back to the pool if the body was read to its end,
        else closed (a worker whose reply is left unread aborts the request)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
            self._pool.done(conn, reuse=False)

    def _release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool.done(conn, reuse=self._keep_alive)

    def _take(self, conn: _Connection) -> bytes:
        """The body bytes in the connection's buffer, framing removed; sets _complete at its end."""
        buffer = conn.buffer
        if not buffer:
            return b""
        if not self._chunked:
            if self._until_close:
                data = bytes(buffer)
                buffer.clear()
                return data
            data = bytes(buffer[:self._left])
            del buffer[:self._left]
            self._left -= len(data)
            self._complete = self._left == 0
            return data
        out: list[bytes | bytearray] = []
        pos, size = 0, len(buffer)
        left = self._left
        while pos < size:
            if left == _SIZE_LINE:
                eol = buffer.find(b"\r\n", pos)
                if eol < 0:
                    if size - pos > _MAX_CHUNK_LINE:
                        raise self._malformed(conn, "a chunk-size line over 1 KiB")
                    break
                chunk = self._chunk_size(conn, buffer[pos:eol])
                pos = eol + 2
                end = pos + chunk
                if chunk == 0:
                    left = _TRAILERS
                elif end + 2 <= size:  # the usual read: the whole chunk and its CRLF
                    if buffer[end:end + 2] != b"\r\n":
                        raise self._malformed(conn, "a chunk not followed by CRLF")
                    out.append(buffer[pos:end])
                    pos = end + 2
                else:
                    left = chunk
            elif left > 0:
                end = min(size, pos + left)
                out.append(buffer[pos:end])
                left -= end - pos
                pos = end
                if left == 0:
                    left = _CHUNK_END
            elif left == _CHUNK_END:
                if size - pos < 2:
                    break
                if buffer[pos:pos + 2] != b"\r\n":
                    raise self._malformed(conn, "a chunk not followed by CRLF")
                pos += 2
                left = _SIZE_LINE
            else:  # the trailers, up to an empty line
                eol = buffer.find(b"\r\n", pos)
                if eol < 0:
                    break
                empty = eol == pos
                pos = eol + 2
                if empty:
                    self._complete = True
                    break
        if pos == size:
            buffer.clear()
        else:
            del buffer[:pos]
        self._left = left
        return b"".join(out)

    def _chunk_size(self, conn: _Connection, line: bytearray) -> int:
        try:
            size = int(line.split(b";", 1)[0] if b";" in line else line, 16)
        except ValueError:
            size = -1
        if size < 0:
            raise self._malformed(conn, f"the chunk size {bytes(line[:40])!r}")
        return size

    def _malformed(self, conn: _Connection, what: str) -> httpx.RemoteProtocolError:
        self.close()
        return httpx.RemoteProtocolError(f"Malformed chunked body from the worker: {what}.")


class StreamPool:
    """Keep-alive connections to the workers, at most `max_connections` calls in flight."""

    def __init__(self, *, read_timeout_s: float, connect_timeout_s: float, idle_s: float,
                 max_connections: int) -> None:
        self.read_timeout_s = read_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._idle_s = idle_s
        self._idle: dict[tuple[str, int, bool], list[_Connection]] = {}
        self._slots = asyncio.Semaphore(max_connections)
        self._busy: set[_Connection] = set()
        self._tls: ssl.SSLContext | None = None

    async def post(self, url: str, body: bytes, headers: dict[str, str], *,
                   head_timeout_s: float | None = None) -> StreamResponse:
        """POST `body` (JSON) to `url` with `headers`; the reply once its status and headers came,
        within `head_timeout_s` when given (FirstByteTimeout past it), else the read timeout."""
        target = _target(url)
        request = bytearray(target.head)
        request += b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
        for name, value in headers.items():
            line = f"{name}: {value}\r\n"
            if "\r" in value or "\n" in value:
                raise httpx.LocalProtocolError(f"The {name} header's value holds a line break.")
            request += line.encode("latin-1")
        request += b"\r\n"
        request += body
        await self._slot()
        try:
            conn = await self._connection(target)
        except BaseException:
            self._slots.release()
            raise
        self._busy.add(conn)
        try:
            assert conn.transport is not None
            conn.transport.write(request)
            return await self._response(conn, head_timeout_s)
        except BaseException:
            conn.close()
            self.done(conn, reuse=False)
            raise

    def done(self, conn: _Connection, *, reuse: bool) -> None:
        """A call is over with `conn`: parked for the next call to its worker, or dropped."""
        if conn not in self._busy:
            return
        self._busy.discard(conn)
        self._slots.release()
        if reuse and conn.clean():
            conn.parked()
            self._idle.setdefault(conn.key, []).append(conn)
        else:
            conn.close()

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()
        for conn in list(self._busy):
            conn.close()

    async def _slot(self) -> None:
        if not self._slots.locked():
            await self._slots.acquire()
            return
        try:
            async with asyncio.timeout(self.read_timeout_s):
                await self._slots.acquire()
        except TimeoutError:
            raise httpx.PoolTimeout("Every upstream connection stayed busy for the pool timeout.") from None

    async def _connection(self, target: _Target) -> _Connection:
        key = (target.host, target.port, target.tls)
        idle = self._idle.get(key)
        if idle:
            now = asyncio.get_running_loop().time()
            while idle:
                conn = idle.pop()
                if conn.clean() and now - conn.idle_since < self._idle_s:
                    return conn
                conn.close()
        loop = asyncio.get_running_loop()
        conn = _Connection(loop, key)
        tls = None
        if target.tls:
            tls = self._tls = self._tls or ssl.create_default_context()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                await loop.create_connection(lambda: conn, target.host, target.port, ssl=tls)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"No connection to {target.host}:{target.port} within "
                                       f"{self._connect_timeout_s:g} s.") from None
        except OSError as exc:
            raise httpx.ConnectError(str(exc) or type(exc).__name__) from exc
        return conn

    async def _response(self, conn: _Connection, head_timeout_s: float | None) -> StreamResponse:
        deadline = None if head_timeout_s is None else conn.loop.time() + head_timeout_s
        while True:
            end = conn.buffer.find(b"\r\n\r\n")
            if end < 0:
                if len(conn.buffer) > _MAX_HEAD:
                    raise httpx.RemoteProtocolError("The worker's response head is over 64 KiB.")
                if conn.closed or conn.eof:
                    raise conn.failure(in_body=False)
                if deadline is None:
                    await conn.wait(self.read_timeout_s)
                    continue
                # The bound is on the whole head, however its bytes trickle in.
                try:
                    await conn.wait(max(0.0, deadline - conn.loop.time()))
                except httpx.ReadTimeout:
                    raise FirstByteTimeout(f"No response from the worker within {head_timeout_s:g} s (the "
                                           "first-byte bound).") from None
                continue
            head = bytes(conn.buffer[:end])
            del conn.buffer[:end + 4]
            status, headers, keep_alive = _parse_head(head)
            if 100 <= status < 200:
                continue  # an interim response (100 Continue): the reply follows
            return StreamResponse(self, conn, status, headers, keep_alive)


def _parse_head(head: bytes) -> tuple[int, dict[bytes, bytes], bool]:
    lines = head.split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    code = rest[:3]
    if not version.startswith(b"HTTP/1.") or len(code) != 3 or not code.isdigit():
        raise httpx.RemoteProtocolError(f"The worker's status line {lines[0][:80]!r} is not HTTP/1.x.")
    headers: dict[bytes, bytes] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon:
            raise httpx.RemoteProtocolError(f"The worker's header line {line[:80]!r} has no colon.")
        name = name.strip().lower()
        value = value.strip()
        headers[name] = headers[name] + b", " + value if name in headers else value
    keep_alive = version == b"HTTP/1.1" and b"close" not in headers.get(b"connection", b"").lower()
    return int(code), headers, keep_alive
