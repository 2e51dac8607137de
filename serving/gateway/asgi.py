"""The completion routes at the ASGI level, in front of Django's handler, in the web process.

Django runs each of its built-in middlewares' hooks through `sync_to_async` under ASGI: about
fifteen thread hops per request, which measured ~10 ms on the 2-core development machine, five
times the gateway's whole budget (bench/gateway.py). None of those middlewares means anything to
`POST /v1/chat/completions` or `/v1/completions` (no session, cookie, CSRF or HTML), so these two
paths go straight to serving.gateway.pipeline (through serving.gateway.wiring, which builds it from
the settings): this is their one entry point. Another method on them is a 405 here; every other
path, `/v1/models` included, is Django's. Django's own URL map (served alone under WSGI or by its
test client) answers the two paths with a 404 saying this application serves them.

What the middleware did for these routes is done here: ALLOWED_HOSTS (a Host Django would refuse
is a 400 here too, logged to `django.security.DisallowedHost` as Django logs it), the body limit
(413), OpenAI-shaped errors, and, as Django's handler does, a client that disconnects cancels the
request (which closes the upstream stream, so the worker aborts). A request with more than one
`Authorization` header is a 400: which one counts would otherwise be a guess.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing, suppress
from typing import Any

from django.conf import settings
from django.http.request import split_domain_port, validate_host

from serving.gateway import wiring
from serving.gateway.errors import GatewayError
from serving.gateway.records import Reply

log = logging.getLogger(__name__)
_host_log = logging.getLogger("django.security.DisallowedHost")

ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
Scope = dict[str, Any]


class _Disconnected(Exception):
    pass


async def _read_body(receive: Any, limit: int) -> bytes:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Disconnected()
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise GatewayError(413, f"The request body is over {limit} bytes; the limit is {limit} bytes.",
                               code="payload_too_large")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _request_headers(scope: Scope) -> tuple[list[str], str | None, str | None]:
    """(every `Authorization` value, `Host`, `X-Forwarded-Host`) of the request, in one pass."""
    authorization: list[str] = []
    host = forwarded_host = None
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            authorization.append(value.decode("latin-1"))
        elif name == b"host":
            host = value.decode("latin-1")
        elif name == b"x-forwarded-host":
            forwarded_host = value.decode("latin-1")
    return authorization, host, forwarded_host


def _check_host(scope: Scope, host: str | None, forwarded_host: str | None) -> None:
    """HttpRequest.get_host()'s rule: the Host (or, with USE_X_FORWARDED_HOST, X-Forwarded-Host)
    must match ALLOWED_HOSTS (in DEBUG with none set, localhost's names)."""
    if settings.USE_X_FORWARDED_HOST and forwarded_host:
        host = forwarded_host
    elif host is None:
        server = scope.get("server") or ("", None)
        host = server[0] if server[1] in (None, 80, 443) else f"{server[0]}:{server[1]}"
    allowed = settings.ALLOWED_HOSTS
    if settings.DEBUG and not allowed:
        allowed = [".localhost", "127.0.0.1", "[::1]"]
    domain, _ = split_domain_port(host)
    if domain and validate_host(domain, allowed):
        return
    _host_log.warning("Invalid HTTP_HOST header: %r. You may need to add %r to ALLOWED_HOSTS.", host, domain)
    raise GatewayError(400, f"The Host header {host!r} is not a host this server answers to; send one of its own "
                       "names (Django's ALLOWED_HOSTS).", code="disallowed_host")


def one_authorization(values: list[str]) -> str | None:
    """The one `Authorization` value, None without one; 400 for several (the same rule as the
    Django views' for /v1, which see them joined by commas)."""
    if len(values) > 1:
        raise GatewayError(400, f"The request has {len(values)} Authorization headers; send exactly one: "
                           "'Authorization: Bearer lp-<prefix>.<secret>'.", code="duplicate_authorization")
    return values[0] if values else None


async def _until_disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _headers(headers: dict[str, str], content_type: str) -> list[tuple[bytes, bytes]]:
    out = [(b"content-type", content_type.encode())]
    out += [(name.lower().encode("latin-1"), value.encode("latin-1")) for name, value in headers.items()]
    return out


async def _send_reply(reply: Reply, send: Any) -> None:
    if reply.stream is None:
        await send({"type": "http.response.start", "status": reply.status,
                    "headers": _headers(reply.headers, "application/json")})
        await send({"type": "http.response.body", "body": reply.body})
        return
    # Closed from here on, however it ends: a client gone before the first event still settles.
    async with aclosing(reply.stream) as events:
        await send({"type": "http.response.start", "status": reply.status,
                    "headers": _headers(reply.headers, "text/event-stream")})
        async for event in events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


async def _error(error: GatewayError, send: Any) -> None:
    await _send_reply(Reply(status=error.status, headers=error.headers, body=error.body()), send)


class GatewayRoutes:
    """The two completion paths here (POST: the pipeline; other methods: 405); everything else to
    `app` (Django)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        endpoint = ROUTES.get(scope.get("path", "")) if scope["type"] == "http" else None
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        try:
            authorizations, host, forwarded_host = _request_headers(scope)
            _check_host(scope, host, forwarded_host)
            if scope.get("method") != "POST":
                raise GatewayError(405, f"Use POST for {scope['path']}.", code="method_not_allowed",
                                   headers={"allow": "POST"})
            authorization = one_authorization(authorizations)
            body = await _read_body(receive, settings.DATA_UPLOAD_MAX_MEMORY_SIZE)
        except _Disconnected:
            return
        except GatewayError as error:
            await _error(error, send)
            return
        work = asyncio.ensure_future(self._respond(endpoint, authorization, body, send))
        watcher = asyncio.ensure_future(_until_disconnect(receive))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not work.done():
                work.cancel()  # the client left: cancelling closes the upstream request
            with suppress(asyncio.CancelledError):
                await work

    async def _respond(self, endpoint: str, authorization: str | None, body: bytes, send: Any) -> None:
        try:
            reply = await wiring.handle(endpoint, authorization=authorization, raw_body=body)
        except GatewayError as error:
            await _error(error, send)
            return
        except Exception:
            log.exception("gateway request to %s failed", endpoint)
            await _error(GatewayError(500, "Internal server error; the platform logged the details.",
                                      code="internal_error"), send)
            return
        await _send_reply(reply, send)
