"""One access line per HTTP request, and its request id, at the edge of a server (ASGI middleware).

Both servers wrap their application in `AccessLog`: the web process (lora_platform.asgi, every
path: the gateway's /v1, the API, the dashboard) and the serving worker (serving.engine.server.serve).
For each request it

- takes the id from `X-Request-ID` when well-formed, else mints one (serving.contracts.request_ids), and
  makes it the current id while the request is served, so every line logged meanwhile carries it
  and the gateway forwards it to the worker it calls;
- sends it back in the response's `X-Request-ID` (unless the application set that header itself);
- writes one line when the response has ended (a stream's last byte, or the client gone): method,
  path, status, duration_ms, and what the application noted about the request with
  `access_note(...)` (the gateway: tenant and model; the worker: model, tokens, outcome).

Probes and scrapes (the `quiet` paths: /health, /metrics, …) are logged at DEBUG, so a load
balancer polling every second does not fill the log. A request whose response never started (the
client left first) has status 499, nginx's "client closed request".
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from contextvars import ContextVar
from typing import Any

from serving.contracts.request_ids import HEADER, request_id_for, request_id_reset, request_id_set

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
# Any ASGI application: Starlette's and the project's own (dict-typed) spell the same dicts differently.
ASGIApp = Callable[[Any, Any, Any], Awaitable[None]]

CLIENT_CLOSED = 499
_HEADER = HEADER.encode()

_notes: ContextVar[dict[str, object] | None] = ContextVar("loraplex_access_notes", default=None)


def access_note(**fields: object) -> None:
    """Add `fields` to the current request's access line (nothing outside a request)."""
    notes = _notes.get()
    if notes is not None:
        notes.update(fields)


class AccessLog:
    def __init__(self, app: ASGIApp, *, logger: str, quiet: Iterable[str] = ()) -> None:
        self.app = app
        self._log = logging.getLogger(logger)
        self._quiet = frozenset(quiet)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = next((value.decode("latin-1") for name, value in scope.get("headers", ()) if name == _HEADER), None)
        request_id = request_id_for(incoming)
        id_token = request_id_set(request_id)
        notes: dict[str, object] = {}
        notes_token = _notes.set(notes)
        status = CLIENT_CLOSED
        started = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = list(message.get("headers", ()))
                if not any(name.lower() == _HEADER for name, _ in headers):
                    message = {**message, "headers": [*headers, (_HEADER, request_id.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except BaseException:
            if status == CLIENT_CLOSED:
                status = 500  # what the server answers for an application that raised
            raise
        finally:
            self._line(scope, request_id, status, (time.perf_counter() - started) * 1000, notes)
            _notes.reset(notes_token)
            request_id_reset(id_token)

    def _line(self, scope: Scope, request_id: str, status: int, duration_ms: float, notes: dict[str, object]) -> None:
        path = scope.get("path", "")
        level = logging.DEBUG if path in self._quiet else logging.INFO
        if not self._log.isEnabledFor(level):
            return
        method = scope.get("method", "")
        noted = "".join(f" {key}={value}" for key, value in notes.items())
        self._log.log(level, "%s %s %s %.1f ms%s", method, path, status, duration_ms, noted,
                      extra={"request_id": request_id, "method": method, "path": path, "status": status,
                             "duration_ms": round(duration_ms, 3), **notes})
