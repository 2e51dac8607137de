"""Every API error is JSON in OpenAI's shape: {"error": {"message", "type", "code", "param"}}.

Clients of the OpenAI API already parse this shape, so the management API uses it too; no API path
ever answers with an HTML page (errors raised outside DRF views are converted by
lora_platform.middleware.ApiJsonErrorsMiddleware).
The body and its status → type table are serving.contracts.errors', the one the gateway and the serving
worker answer with too.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import PermissionDenied as DjangoPermissionDenied
from django.core.exceptions import ValidationError as DjangoValidationError
from django.http import Http404, JsonResponse
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from serving.contracts.errors import ServiceError, default_code, error_body
from serving.contracts.errors import error_type as type_of_status


def error_response(status_code: int, message: str, *, code: str | None = None, param: str | None = None,
                   error_type: str | None = None, headers: dict[str, str] | None = None) -> JsonResponse:
    """A plain Django JSON error, for code outside DRF (middleware, URL handlers, the gateway)."""
    body = error_body(message, error_type=error_type or type_of_status(status_code),
                      code=code or default_code(status_code), param=param)
    response = JsonResponse(body, status=status_code)
    for name, value in (headers or {}).items():
        response[name] = value
    return response


def _flatten(detail: Any, prefix: str = "") -> list[tuple[str, str]]:
    """DRF's nested error detail as (field path, message) pairs, in order."""
    if isinstance(detail, dict):
        pairs: list[tuple[str, str]] = []
        for key, value in detail.items():
            name = key if key != "non_field_errors" else ""
            pairs.extend(_flatten(value, f"{prefix}.{name}" if prefix and name else (name or prefix)))
        return pairs
    if isinstance(detail, list):
        pairs = []
        for index, value in enumerate(detail):
            inner = prefix if not isinstance(value, (dict, list)) else f"{prefix}[{index}]"
            pairs.extend(_flatten(value, inner))
        return pairs
    return [(prefix, str(detail))]


def _validation_message(detail: Any) -> tuple[str, str | None]:
    pairs = _flatten(detail)
    message = "; ".join(f"{field}: {text}" if field else text for field, text in pairs)
    return message or "Invalid request.", (pairs[0][0] or None) if pairs else None


def openai_exception_handler(exc: Exception, context: dict[str, Any]) -> Response | None:
    """DRF exception handler producing OpenAI-shaped bodies for every error."""
    if isinstance(exc, ServiceError):
        body = error_body(exc.message, error_type=exc.error_type, code=exc.code, param=exc.param)
        return Response(body, status=exc.status_code)
    if isinstance(exc, DjangoValidationError):
        exc = exceptions.ValidationError(exc.message_dict if hasattr(exc, "error_dict") else exc.messages)
    elif isinstance(exc, Http404):
        exc = exceptions.NotFound(str(exc) or "Not found.")
    elif isinstance(exc, DjangoPermissionDenied):
        exc = exceptions.PermissionDenied(str(exc) or None)

    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    code: str
    if isinstance(exc, exceptions.ValidationError):
        message, param = _validation_message(exc.detail)
        code = "invalid_request"
    else:
        detail = exc.detail if isinstance(exc, exceptions.APIException) else str(exc)
        message = str(detail)
        param = None
        codes = exc.get_codes() if isinstance(exc, exceptions.APIException) else None
        code = codes if isinstance(codes, str) else default_code(response.status_code)
    if response.status_code == status.HTTP_401_UNAUTHORIZED:
        code = "invalid_api_key" if code in ("not_authenticated", "authentication_failed") else code
    response.data = error_body(
        message,
        error_type=type_of_status(response.status_code),
        code=code,
        param=param,
    )
    return response
