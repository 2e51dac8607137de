"""Errors in OpenAI's JSON shape, `{"error": {"message", "type", "param", "code"}}`, with the status
OpenAI's clients map to their exception classes (400 BadRequestError, 401 AuthenticationError,
404 NotFoundError, 409 ConflictError, 503 InternalServerError with retries). Nothing leaves as
plain text: an unexpected exception is a JSON 500 naming its type, the traceback goes to the log.
The body and its status → type table are serving.contracts.errors', shared with the gateway and the API."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.contracts import errors as wire
from serving.contracts.registry import SLOT_CORRUPTED

log = logging.getLogger(__name__)


class APIError(Exception):
    """An error to send to the client as it is: `message` is shown to the caller, so it says what
    was wrong and, where it helps, what to do."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def bad_request(message: str, *, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str) -> APIError:
    return APIError(
        404,
        f"The model `{model}` does not exist on this worker; GET /v1/models lists the served models.",
        param="model",
        code="model_not_found",
    )


def slot_corrupted(message: str) -> APIError:
    """A request stopped because its adapter's GPU slot failed its checksum (engine
    SlotCorruptedError). 503: the worker's state (the slot is being reloaded), not the request's or
    the adapter's, so the gateway fails over before the first byte, and its breaker counts it
    neither as a 503 nor as a stream's error event (docs/resilience.md)."""
    return APIError(503, message, code=SLOT_CORRUPTED)


def overloaded(message: str) -> APIError:
    return APIError(503, message, code="overloaded")


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's body; an error raised without a code gets its status's (serving.contracts.errors.default_code)."""
    return wire.error_body(message, error_type=wire.error_type(status), code=code or wire.default_code(status),
                           param=param)


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error_body(error.status, error.message, param=error.param, code=error.code), error.status)


def install_error_handlers(app: FastAPI) -> None:
    """Every error the app returns, its own or the framework's, leaves in the OpenAI shape."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        problems = []
        for err in exc.errors():
            where = ".".join(str(part) for part in err.get("loc", ()) if part != "body")
            problems.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
        # The request's field (`logit_bias`, `messages`), not the last step of pydantic's path to the
        # value, which may be a dict key ("5") or a union member's type ("list[str]").
        first_param = next((str(loc[1] if loc[0] == "body" and len(loc) > 1 else loc[-1])
                            for e in exc.errors() if (loc := e.get("loc"))), None)
        return error_response(APIError(400, "; ".join(problems) or "invalid request body", param=first_param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(exc.status_code, str(exc.detail), param=getattr(exc, "param", None),
                                       code=getattr(exc, "code", None)))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Starlette calls this from its outermost middleware and re-raises afterwards, so uvicorn
        # still logs the traceback; the caller gets the shape its client parses, not plain text.
        log.error("%s %s failed: %s: %s", request.method, request.url.path, type(exc).__name__, exc)
        return error_response(APIError(
            500, f"The worker failed on this request ({type(exc).__name__}); its log has the details.",
            code="internal_error"))
