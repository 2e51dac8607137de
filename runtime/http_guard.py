"""Connection guards uvicorn's HTTP/1.1 server (h11) lacks: a header-read deadline, a body-read
idle timeout and a cap on connections per client address. Used by the web process and the serving
worker (docs/web-server.md).

uvicorn arms its keep-alive timer only once a response is complete, and disarms it on the next byte
received, so a connection that never finishes its request headers (nothing sent, half a request
line, headers trickled a byte at a time) is kept for ever: 200 such sockets stayed open for 60 s in
an attack run (docs/security.md). Here every request must complete its headers within
`header_timeout_s` of its first byte (of the connection's opening, for the first request), or it
gets a 408 and the connection is closed. Between requests uvicorn's keep-alive timeout
(`--timeout-keep-alive`) still applies.

Once the headers are in, the body must keep coming: no more than `body_idle_timeout_s` between two
of its reads (nginx's `client_body_timeout`), or a 408 and the connection closed; a body sent a
byte a minute would otherwise hold the application's request open for ever. Each read pushes the
deadline back, so a large upload on a slow link is not cut, and the time the server itself stops
reading (uvicorn's flow control, while the application has not taken what came) does not count.

uvicorn's own `limit_concurrency` counts all connections together (503 past it); the cap here
refuses one address's connection past `max_connections_per_client` at once, with a 503, so one
client cannot hold every socket the process has.

Django-free: the serving worker imports it as the web process does.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any, ClassVar
from weakref import WeakKeyDictionary

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

# One count of open connections per server (one per uvicorn.Server, so tests with several servers
# in a process stay apart), by client address.
_OPEN: WeakKeyDictionary[ServerState, Counter[str]] = WeakKeyDictionary()


def _raw_response(status: str, message: str, extra_headers: str = "") -> bytes:
    """A complete response written outside h11: there is no request (yet) that h11 would answer."""
    body = message.encode()
    return (f"HTTP/1.1 {status}\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n{extra_headers}\r\n").encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the two guards; subclass with `guarded_h11_protocol`."""

    header_timeout_s: ClassVar[float] = 10.0
    body_idle_timeout_s: ClassVar[float] = 60.0  # 0: none
    max_connections_per_client: ClassVar[int] = 0  # 0: no cap

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_deadline: asyncio.TimerHandle | None = None
        self._body_deadline: asyncio.TimerHandle | None = None
        self._counted_as: str | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        address = self.client[0] if self.client else None
        if address is not None and self.max_connections_per_client > 0:
            counts = _OPEN.setdefault(self.server_state, Counter())
            if counts[address] >= self.max_connections_per_client:
                transport.write(_raw_response(
                    "503 Service Unavailable",
                    f"Too many connections from {address}: at most {self.max_connections_per_client} at once.\n",
                    "retry-after: 1\r\n"))
                transport.close()
                return
            counts[address] += 1
            self._counted_as = address
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        self._disarm_body_deadline()
        if self._counted_as is not None:
            counts = _OPEN.get(self.server_state)
            if counts is not None:
                counts[self._counted_as] -= 1
                if counts[self._counted_as] <= 0:
                    del counts[self._counted_as]
            self._counted_as = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow_request_state(bytes_waiting=True)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # A pipelined request's bytes may already be buffered; without any, the keep-alive timer
        # alone watches the idle connection.
        self._follow_request_state(bytes_waiting=bool(self.conn.trailing_data[0]))

    def _follow_request_state(self, *, bytes_waiting: bool) -> None:
        """The deadline runs while a request's headers are incomplete: h11 still waits for them
        (their state IDLE) and some of them came. It is never pushed back by more bytes."""
        if self.transport.is_closing():
            return
        if self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE:
            if bytes_waiting:
                self._arm_header_deadline()
        else:
            self._disarm_header_deadline()
        # Every read of a body still coming pushes its deadline back.
        self._disarm_body_deadline()
        if self.conn.their_state is h11.SEND_BODY and self.body_idle_timeout_s > 0:
            self._body_deadline = self.loop.call_later(self.body_idle_timeout_s, self._body_timed_out)

    def _arm_header_deadline(self) -> None:
        if self._header_deadline is None and self.header_timeout_s > 0:
            self._header_deadline = self.loop.call_later(self.header_timeout_s, self._header_timed_out)

    def _disarm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _header_timed_out(self) -> None:
        self._header_deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        self._unset_keepalive_if_required()
        self.transport.write(_raw_response(
            "408 Request Timeout", f"Request headers not complete within the header timeout "
                                   f"({self.header_timeout_s:g} s).\n"))
        self.transport.close()

    def _disarm_body_deadline(self) -> None:
        if self._body_deadline is not None:
            self._body_deadline.cancel()
            self._body_deadline = None

    def _body_timed_out(self) -> None:
        self._body_deadline = None
        if self.transport.is_closing() or self.conn.their_state is not h11.SEND_BODY:
            return
        if self.flow.read_paused:
            # The server stopped reading (the application has not taken what came): not the
            # client's gap. Watch again from now.
            self._body_deadline = self.loop.call_later(self.body_idle_timeout_s, self._body_timed_out)
            return
        self._unset_keepalive_if_required()
        if self.conn.our_state is h11.SEND_RESPONSE:  # the application has not answered yet
            self.transport.write(_raw_response(
                "408 Request Timeout", f"Request body stalled: no bytes for the body timeout "
                                       f"({self.body_idle_timeout_s:g} s).\n"))
        self.transport.close()


def guarded_h11_protocol(
    *, header_timeout_s: float, max_connections_per_client: int, keep_alive_s: float | None = None,
    body_idle_timeout_s: float = 60.0,
) -> type[GuardedH11Protocol]:
    """The protocol class to give uvicorn (`http=`, or `--http module:attribute`). `keep_alive_s`
    overrides the server's `timeout_keep_alive` (for servers started from uvicorn's command line)."""
    if (header_timeout_s < 0 or body_idle_timeout_s < 0 or max_connections_per_client < 0
            or (keep_alive_s is not None and keep_alive_s <= 0)):
        raise ValueError(f"header_timeout_s ({header_timeout_s}), body_idle_timeout_s ({body_idle_timeout_s}) and "
                         f"max_connections_per_client ({max_connections_per_client}) must be >= 0, "
                         f"keep_alive_s ({keep_alive_s}) > 0")

    class Guarded(GuardedH11Protocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if keep_alive_s is not None:
                self.timeout_keep_alive = keep_alive_s  # type: ignore[assignment]  # uvicorn's is an int

    Guarded.header_timeout_s = header_timeout_s
    Guarded.body_idle_timeout_s = body_idle_timeout_s
    Guarded.max_connections_per_client = max_connections_per_client
    return Guarded
