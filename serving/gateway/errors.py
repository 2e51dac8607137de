"""The gateway's refusals, in OpenAI's error shape, with the headers that go with them."""

from __future__ import annotations

import json

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    429: "rate_limit_error",
}


class GatewayError(Exception):
    """A request the gateway answers itself: status, OpenAI `code`, message, `param`, headers."""

    def __init__(self, status: int, message: str, *, code: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = dict(headers or {})

    @property
    def error_type(self) -> str:
        return _TYPE_BY_STATUS.get(self.status, "api_error")

    def fresh(self) -> GatewayError:
        """A new error with the same answer, to raise in place of a cached one: raising the cached
        object itself would grow its traceback with every request that hit it (and keep their
        frames, bodies included, alive as long as the cache keeps it)."""
        return GatewayError(self.status, self.message, code=self.code, param=self.param, headers=self.headers)

    def body(self) -> bytes:
        return error_json(self.message, error_type=self.error_type, code=self.code, param=self.param)


def error_json(message: str, *, error_type: str, code: str | None, param: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": error_type, "param": param, "code": code}}).encode()


def invalid_request(message: str, *, param: str | None = None, code: str = "invalid_request") -> GatewayError:
    return GatewayError(400, message, code=code, param=param)


def model_not_found(model: str) -> GatewayError:
    """The same answer for an unknown name and for another tenant's adapter, so neither leaks."""
    return GatewayError(404, f"The model '{model}' does not exist or you do not have access to it.",
                        code="model_not_found", param="model")
