"""The errors every side raises and answers in OpenAI's shape: Django-free, so the platform's services,
the blob storage (serving.wire.storage) and the serving worker's reader raise and catch the same
classes; the API layer (lora_platform.api_errors) turns each into an OpenAI-shaped JSON error.

Services must not know about HTTP, but each failure has one natural status, so it is carried here
rather than re-decided in every view.
"""

from __future__ import annotations


class ServiceError(Exception):
    """A request the platform refuses, with a message that tells the caller what to change."""

    status_code = 400
    error_type = "invalid_request_error"
    code = "invalid_request"

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.param = param


class InvalidInput(ServiceError):
    """The input itself is wrong (a field, a file, a parameter)."""


class NotFound(ServiceError):
    status_code = 404
    error_type = "not_found_error"
    code = "not_found"


class Conflict(ServiceError):
    """The input is fine but the current state forbids it (a duplicate name, a resource in use)."""

    status_code = 409
    error_type = "conflict_error"
    code = "conflict"


class LimitExceeded(ServiceError):
    """A tier or platform limit stands in the way (max adapters, max concurrent jobs, file size)."""

    status_code = 403
    error_type = "limit_exceeded_error"
    code = "limit_exceeded"


class PayloadTooLarge(ServiceError):
    status_code = 413
    error_type = "invalid_request_error"
    code = "payload_too_large"
