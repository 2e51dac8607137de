"""The request-body limit at the ASGI level, around the whole web application (lora_platform.asgi).

Django's ASGI handler reads the whole body into a temporary file (on disk past
FILE_UPLOAD_MAX_MEMORY_SIZE) before any middleware or view runs, so a limit checked there comes
after an unauthenticated 600 MB body was written to disk (docs/security.md). Here the body is
refused before that: by its `Content-Length` before a byte of it is read, and, chunked, the moment
the bytes received pass the limit (the application then sees the client gone, and reads no more).
The answer is a 413 in OpenAI's error shape, and the connection is closed (`connection: close`),
so the rest of the body is never read.

The limit is DATA_UPLOAD_MAX_MEMORY_SIZE (what Django allows a non-file body anyway) on every route
but the gateway's completion routes, whose limit is the serving worker's own (settings.GATEWAY's
`max_body_bytes`, GATEWAY_MAX_BODY_BYTES: a body the worker would refuse is refused here, before the
gateway parses, admits and charges it), and the upload routes (UPLOAD_VIEWS). There a caller whose credentials may upload
(tenants.upload_caller: an API key with the `manage` scope of an active tenant, or a dashboard
session of an owner or member of one; the presence of a key or a cookie is not enough) gets its
own limit: what its tenant may upload to that route (a dataset: its tier's
TRAINING_DATASET_MAX_BYTES_BY_TIER; a part of an upload: 64 MiB at most; an adapter:
ADAPTER_MAX_BYTES), plus DATA_UPLOAD_MAX_MEMORY_SIZE for the form's other fields and framing, and
never more than MAX_UPLOAD_BYTES. So a 400 MiB upload on a tier allowed 100 MiB is refused by its
Content-Length before a byte is read, or, chunked, once 102 MiB have come, not after Django spooled
all of it (issue 37). Checking the credentials costs a database query or two, paid only by a body on
an upload route that is over the small limit. The view still authenticates and authorises as it
always does, and its upload handler stops a file at the exact limit; this decides only how many
bytes are read. Docs: docs/web-server.md, docs/security.md.
"""

from __future__ import annotations

import json
from http.cookies import CookieError, SimpleCookie
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.urls import Resolver404, resolve

from serving.gateway.asgi import ROUTES as COMPLETION_ROUTES
from serving.contracts.errors import error_body, error_type
from tenants.models import Tenant
from tenants.upload_caller import upload_tenant
from training import conf
from training.uploads import PART_MAX_BYTES

# The views that take files (their URL names), by what they take: datasets (API, OpenAI files,
# dashboard), a part of an OpenAI upload, adapter versions (API, dashboard).
DATASET_VIEWS = frozenset({"dataset-list", "openai-files", "dashboard:dataset-upload"})
PART_VIEWS = frozenset({"openai-upload-parts"})
ADAPTER_VIEWS = frozenset({"adapter-versions", "dashboard:adapter-upload"})
UPLOAD_VIEWS = DATASET_VIEWS | PART_VIEWS | ADAPTER_VIEWS

Scope = dict[str, Any]
Message = dict[str, Any]


def _upload_view(scope: Scope) -> str | None:
    """The upload view this request is for (a POST to one of UPLOAD_VIEWS), else None."""
    if scope.get("method") != "POST":
        return None
    try:
        name = resolve(scope["path"]).view_name
    except Resolver404:
        return None
    return name if name in UPLOAD_VIEWS else None


def _header_values(scope: Scope, name: bytes) -> list[bytes]:
    return [value for key, value in scope.get("headers", []) if key == name]


def upload_file_limit(view_name: str, tenant: Tenant) -> tuple[int, str]:
    """The most file bytes `tenant` may send to the upload view `view_name`, and what sets that."""
    if view_name in ADAPTER_VIEWS:
        return settings.ADAPTER_MAX_BYTES, "an adapter's files may be at most {} bytes (ADAPTER_MAX_BYTES)"
    limit = conf.dataset_max_bytes(tenant.tier.name)
    if view_name in PART_VIEWS and PART_MAX_BYTES < limit:
        return PART_MAX_BYTES, "a part of an upload may be at most {} bytes"
    return limit, f"datasets on tier '{tenant.tier.name}' may be at most {{}} bytes"


def _caller_limit(scope: Scope, view_name: str) -> tuple[int, str] | None:
    """The body limit of this caller on this upload route and why; None without valid credentials."""
    authorization = [value.decode("latin-1") for value in _header_values(scope, b"authorization")]
    tenant = upload_tenant(authorization, _session_key(scope))
    if tenant is None:
        return None
    file_limit, why = upload_file_limit(view_name, tenant)
    # The form's other fields and the multipart framing: Django allows the fields this much anyway.
    body_limit = file_limit + settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    if body_limit >= settings.MAX_UPLOAD_BYTES:
        return settings.MAX_UPLOAD_BYTES, "MAX_UPLOAD_BYTES, the most any upload may be"
    return body_limit, (why.format(file_limit) + f", plus {settings.DATA_UPLOAD_MAX_MEMORY_SIZE} bytes for the "
                        "form's other fields")


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
    """One request's limit: the small one, raised to the caller's upload limit once the credentials
    are checked (at most once, and only when the body needs it)."""

    def __init__(self, scope: Scope) -> None:
        self.scope = scope
        self.bytes = (settings.GATEWAY.max_body_bytes if scope.get("path") in COMPLETION_ROUTES
                      else settings.DATA_UPLOAD_MAX_MEMORY_SIZE)
        self.upload_view = _upload_view(scope)
        self.checked = False
        self.why: str | None = None  # what set the raised limit

    async def allows(self, size: int) -> bool:
        if size > self.bytes and self.upload_view is not None and not self.checked:
            self.checked = True
            raised = await sync_to_async(_caller_limit)(self.scope, self.upload_view)
            if raised is not None:
                self.bytes, self.why = raised
        return size <= self.bytes

    def refusal(self, size: int | None) -> bytes:
        said = f"The request body is {size} bytes" if size is not None else "The request body goes on past the limit"
        message = f"{said}; the limit is {self.bytes} bytes"
        if self.why is not None:
            message += f" ({self.why})."
        elif self.upload_view is not None:
            message += (". Uploads need valid credentials: an API key with the manage scope, or a dashboard "
                        "session of a tenant's owner or member; the limit is then the tenant's.")
        else:
            message += "."
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
