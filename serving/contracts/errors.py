"""OpenAI's error body and the errors every side raises in it: Django-free, so the gateway, the
management API (api.errors) and the serving worker (serving.engine.server.errors) answer
with one body and one status → type table, and the platform's services, the blob storage
(runtime.storage) and the worker's reader raise and catch the same classes.

The body is OpenAI's: `{"error": {"message", "type", "param", "code"}}` (`error_body`). The type is
`error_type(status)`, from the one table `TYPE_BY_STATUS`; anything it does not name is "api_error".

The table, decided against what OpenAI's API and SDK do:
- 404 is "invalid_request_error", as OpenAI's API answers an unknown model
  (`{"type": "invalid_request_error", "code": "model_not_found"}`) or file. The three tables this
  one replaced disagreed (the gateway said so; the management API and the worker said
  "not_found_error", which is Anthropic's type, not OpenAI's). What a missing thing is goes in
  `code` (model_not_found, not_found, ...).
- The OpenAI SDK picks its exception class by status alone (400 BadRequestError, 401
  AuthenticationError, 403 PermissionDeniedError, 404 NotFoundError, 409 ConflictError, 429
  RateLimitError, 5xx InternalServerError, with retries on 409, 429 and 5xx) and shows `type` as it
  came, so the table changes no client's control flow.
- 401 stays "authentication_error", 403 "permission_error", 409 "conflict_error", 429
  "rate_limit_error", where the three tables agreed (OpenAI itself sends "invalid_request_error"
  with code invalid_api_key on a 401; the type names the class of problem more usefully here).
- A service's LimitExceeded (403) is "permission_error" with its code (limit_exceeded, ...); it
  had a type of its own, "limit_exceeded_error", that no OpenAI client knows.
- 5xx are "api_error", as the gateway and the API answered them (the worker's own
  "internal_server_error" and "service_unavailable" went with its table).

Every body carries a `code` programs can test: an error raised without one of its own gets its
status's (`default_code`: `invalid_request`, `not_found`, ... as the classes below default to); what
a missing thing is, or why a request is refused, is a code of its own where it is raised
(model_not_found, file_not_found, context_length_exceeded, ...).

Services must not know about HTTP, but each failure has one natural status, so it is carried here
rather than re-decided in every view; its type follows from the status.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
}


CODE_BY_STATUS = {
    400: "invalid_request",
    401: "invalid_api_key",
    403: "permission_denied",
    404: "not_found",
    409: "conflict",
    413: "payload_too_large",
    500: "internal_error",
}


def error_type(status: int) -> str:
    """The OpenAI error type of an HTTP status (module docstring)."""
    return TYPE_BY_STATUS.get(status, "api_error")


def default_code(status: int) -> str:
    """The `code` of an error of `status` raised without one: the table's, else the status's phrase
    (`method_not_allowed`, `service_unavailable`, ...)."""
    if status in CODE_BY_STATUS:
        return CODE_BY_STATUS[status]
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        return "api_error" if status >= 500 else "invalid_request"
    return phrase.lower().replace(" ", "_").replace("-", "_")


def error_body(message: str, *, error_type: str, code: str | None, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error body, JSON-ready."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


class ServiceError(Exception):
    """A request the platform refuses, with a message that tells the caller what to change."""

    status_code = 400
    code = "invalid_request"

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.param = param

    @property
    def error_type(self) -> str:
        return error_type(self.status_code)


class InvalidInput(ServiceError):
    """The input itself is wrong (a field, a file, a parameter)."""


class NotFound(ServiceError):
    status_code = 404
    code = "not_found"


class Conflict(ServiceError):
    """The input is fine but the current state forbids it (a duplicate name, a resource in use)."""

    status_code = 409
    code = "conflict"


class LimitExceeded(ServiceError):
    """A tier or platform limit stands in the way (max adapters, max concurrent jobs, file size)."""

    status_code = 403
    code = "limit_exceeded"


class PayloadTooLarge(ServiceError):
    status_code = 413
    code = "payload_too_large"
