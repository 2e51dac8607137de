"""API middleware: oversized bodies refused up front (JSON 413), and no HTML error page under the API."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any, Callable

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.http import HttpRequest, HttpResponse

from api.errors import error_response

API_PREFIXES = ("/api/", "/v1/")


class _SyncAndAsync:
    """Runs in the mode of the handler around it: a sync-only middleware would make Django run
    every async view (the /v1 gateway) through a thread hop, one request at a time."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response: Callable[[HttpRequest], Any]) -> None:
        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def __call__(self, request: HttpRequest) -> Any:
        if iscoroutinefunction(self):
            return self._acall(request)
        early = self.before(request)
        return early if early is not None else self.after(request, self.get_response(request))

    async def _acall(self, request: HttpRequest) -> HttpResponse:
        early = self.before(request)
        return early if early is not None else self.after(request, await self.get_response(request))

    def before(self, request: HttpRequest) -> HttpResponse | None:
        return None

    def after(self, request: HttpRequest, response: HttpResponse) -> HttpResponse:
        return response


class BodySizeLimitMiddleware(_SyncAndAsync):
    """JSON bodies are capped at DATA_UPLOAD_MAX_MEMORY_SIZE, multipart uploads at MAX_UPLOAD_BYTES.

    Django would otherwise raise RequestDataTooBig deep inside a view as a generic 400; checking the
    declared length here gives the caller a 413 that names the limit. Streaming uploads enforce the
    same limit again while they read, since Content-Length can lie.

    Under uvicorn this comes too late for the disk: Django's ASGI handler has spooled the body to a
    temporary file before any middleware runs. lora_platform.body_limit refuses first there, on
    every route; this stays for Django's own handlers (the WSGI entry point, the test client).
    """

    def before(self, request: HttpRequest) -> HttpResponse | None:
        if request.path.startswith(API_PREFIXES):
            try:
                length = int(request.META.get("CONTENT_LENGTH") or 0)
            except ValueError:
                return error_response(400, "Content-Length is not a number.", code="invalid_content_length")
            multipart = request.content_type == "multipart/form-data"
            limit = settings.MAX_UPLOAD_BYTES if multipart else settings.DATA_UPLOAD_MAX_MEMORY_SIZE
            if length > limit:
                kind = "upload" if multipart else "request body"
                return error_response(
                    413,
                    f"The {kind} is {length} bytes; the limit is {limit} bytes.",
                    code="payload_too_large",
                )
        return None


class ApiJsonErrorsMiddleware(_SyncAndAsync):
    """Under /api/ and /v1/, every error response that is not JSON becomes an OpenAI-shaped one.

    DRF views already answer errors in JSON (api.errors.openai_exception_handler), but some errors
    happen outside them: an unknown path (404), a method a plain Django view does not allow (405), an
    uncaught exception (500, an HTML debug page when DEBUG is on), a CSRF or host check (400/403).
    Converting the finished response here catches all of them in one place, whatever DEBUG is; other
    paths (admin, dashboard) keep Django's HTML pages.
    """

    def after(self, request: HttpRequest, response: HttpResponse) -> HttpResponse:
        if (
            response.status_code < 400
            or not request.path.startswith(API_PREFIXES)
            or response.get("Content-Type", "").startswith("application/json")
        ):
            return response
        status = response.status_code
        headers = {name: response[name] for name in ("Allow", "Retry-After") if response.has_header(name)}
        if status == 404:
            return error_response(404, f"No route for {request.method} {request.path}.", code="not_found")
        if status == 405:
            allowed = f" Allowed: {headers['Allow']}." if "Allow" in headers else ""
            return error_response(405, f"Method {request.method} is not allowed on {request.path}.{allowed}",
                                  code="method_not_allowed", headers=headers)
        if status >= 500:
            return error_response(status, "Internal server error; the platform logged the details.",
                                  code="internal_error", headers=headers)
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = "Request refused"
        # The code is the status's own (serving.contracts.errors.default_code), as on every other surface.
        return error_response(status, f"{phrase}.", headers=headers)
