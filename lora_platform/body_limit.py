"""The request-body limit at the ASGI level, around the whole web application (lora_platform.asgi).

Django's ASGI handler reads the whole body into a temporary file (on disk past
FILE_UPLOAD_MAX_MEMORY_SIZE) before any middleware or view runs, so a limit checked there comes
after an unauthenticated 600 MB body was written to disk (docs/security.md). Here the body is
refused before that: by its `Content-Length` before a byte of it is read, and, chunked, the moment
the bytes received pass the limit (the application then sees the client gone, and reads no more).
The answer is a 413 in OpenAI's error shape, and the connection is closed (`connection: close`),
so the rest of the body is never read.

The limit is DATA_UPLOAD_MAX_MEMORY_SIZE (what Django allows a non-file body anyway) on every route
but the upload routes (UPLOAD_VIEWS), which allow MAX_UPLOAD_BYTES to a caller whose credentials
are valid: an API key that may write (the `manage` scope, of an active tenant), or a dashboard
session of a user who is an owner or member of an active tenant. The presence of a key or a
session cookie is not enough: the key is checked by the API's own authentication code
(tenants.authentication.api_key_authenticate) and the session by Django's (the session store and
`auth.get_user`, which checks the user's session hash). That costs a database query or two, and is
paid only by a body on an upload route that is over the small limit. The view still authenticates
and authorises as it always does; this decides only how many bytes are read. Docs: docs/web-server.md.
"""

from __future__ import annotations

import json
from http.cookies import CookieError, SimpleCookie
from importlib import import_module
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth import get_user
from django.http import HttpRequest
from django.urls import Resolver404, resolve
from rest_framework.exceptions import APIException

from serving.wire.errors import error_body, error_type
from tenants.authentication import api_key_authenticate
from tenants.models import Membership, Tenant

# The views that take files (their URL names): datasets (API, OpenAI files and upload parts, dashboard)
# and adapter versions (API, dashboard).
UPLOAD_VIEWS = frozenset({"dataset-list", "openai-files", "openai-upload-parts", "dashboard:dataset-upload",
                          "adapter-versions", "dashboard:adapter-upload"})

Scope = dict[str, Any]
Message = dict[str, Any]


def _is_upload_route(scope: Scope) -> bool:
    if scope.get("method") != "POST":
        return False
    try:
        return resolve(scope["path"]).view_name in UPLOAD_VIEWS
    except Resolver404:
        return False


def _header_values(scope: Scope, name: bytes) -> list[bytes]:
    return [value for key, value in scope.get("headers", []) if key == name]


def _may_upload(scope: Scope) -> bool:
    """Whether the request's credentials are valid for an upload (see the module's docstring)."""
    authorization = _header_values(scope, b"authorization")
    if len(authorization) == 1:
        try:
            return api_key_authenticate(authorization[0].decode("latin-1")).can_write()
        except APIException:
            return False
    if authorization:  # two Authorization headers: ambiguous, so no credentials at all
        return False
    session_key = _session_key(scope)
    if session_key is None:
        return False
    request = HttpRequest()
    request.session = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
    user = get_user(request)
    return bool(user.is_authenticated and user.is_active and Membership.objects.filter(
        user=user, tenant__status=Tenant.Status.ACTIVE, role__in=(Membership.Role.OWNER, Membership.Role.MEMBER)).exists())


def _session_key(scope: Scope) -> str | None:
    for header in _header_values(scope, b"cookie"):
        cookie: SimpleCookie = SimpleCookie()
        try:
            cookie.load(header.decode("latin-1"))
        except CookieError:  # a malformed cookie header carries no session
            continue
        if settings.SESSION_COOKIE_NAME in cookie:
            return cookie[settings.SESSION_COOKIE_NAME].value
    return None


class _Limit:
    """One request's limit: the small one, raised to the upload limit once the credentials are
    checked (at most once, and only when the body needs it)."""

    def __init__(self, scope: Scope) -> None:
        self.scope = scope
        self.bytes = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        self.upload_route = _is_upload_route(scope)
        self.checked = False

    async def allows(self, size: int) -> bool:
        if size > self.bytes and self.upload_route and not self.checked:
            self.checked = True
            if await sync_to_async(_may_upload)(self.scope):
                self.bytes = settings.MAX_UPLOAD_BYTES
        return size <= self.bytes

    def refusal(self, size: int | None) -> bytes:
        said = f"The request body is {size} bytes" if size is not None else "The request body goes on past the limit"
        message = f"{said}; the limit is {self.bytes} bytes."
        if self.upload_route and self.bytes < settings.MAX_UPLOAD_BYTES:
            message += (f" Uploads up to {settings.MAX_UPLOAD_BYTES} bytes need valid credentials: an API key "
                        "with the manage scope, or a dashboard session of a tenant's owner or member.")
        return json.dumps(error_body(message, error_type=error_type(413), code="payload_too_large")).encode()


async def _send_413(send: Any, body: bytes) -> None:
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """ASGI middleware: `BodyLimit(app)`; the limits are read from the settings on each request."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = _Limit(scope)
        declared = _header_values(scope, b"content-length")
        # The server (h11) has refused a malformed or conflicting Content-Length already.
        size = int(declared[0]) if declared and declared[0].isdigit() else None
        if size is not None and not await limit.allows(size):
            await _send_413(send, limit.refusal(size))
            return

        received = 0
        over = False
        started = False

        async def counting_receive() -> Message:
            nonlocal received, over
            if over:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit.bytes and not await limit.allows(received):
                    # To the application, the client has gone: Django drops what it buffered.
                    over = True
                    return {"type": "http.disconnect"}
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, counting_receive, tracking_send)
        if over and not started:
            await _send_413(send, limit.refusal(None))
