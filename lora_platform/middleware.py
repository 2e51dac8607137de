"""Refuses oversized API bodies up front, with a JSON 413, before any view reads them."""

from __future__ import annotations

from typing import Callable

from django.conf import settings
from django.http import HttpRequest, HttpResponse

from lora_platform.api_errors import error_response

API_PREFIXES = ("/api/", "/v1/")


class BodySizeLimitMiddleware:
    """JSON bodies are capped at DATA_UPLOAD_MAX_MEMORY_SIZE, multipart uploads at MAX_UPLOAD_BYTES.

    Django would otherwise raise RequestDataTooBig deep inside a view as a generic 400; checking the
    declared length here gives the caller a 413 that names the limit. Streaming uploads enforce the
    same limit again while they read, since Content-Length can lie.
    """

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
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
        return self.get_response(request)
