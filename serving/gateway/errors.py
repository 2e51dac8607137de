"""The gateway's refusals, in OpenAI's error shape, with the headers that go with them."""

from __future__ import annotations

import json

from serving.contracts import errors as wire


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
        return wire.error_type(self.status)

    def fresh(self) -> GatewayError:
        """A new error with the same answer, to raise in place of a cached one: raising the cached
        object itself would grow its traceback with every request that hit it (and keep their
        frames, bodies included, alive as long as the cache keeps it)."""
        return GatewayError(self.status, self.message, code=self.code, param=self.param, headers=self.headers)

    def body(self) -> bytes:
        return error_json(self.message, error_type=self.error_type, code=self.code, param=self.param)


def error_json(message: str, *, error_type: str, code: str | None, param: str | None = None) -> bytes:
    return json.dumps(wire.error_body(message, error_type=error_type, code=code, param=param)).encode()


def invalid_request(message: str, *, param: str | None = None, code: str = "invalid_request") -> GatewayError:
    return GatewayError(400, message, code=code, param=param)


def model_not_found(model: str) -> GatewayError:
    """The same answer for an unknown name and for another tenant's adapter, so neither leaks."""
    return GatewayError(404, f"The model '{model}' does not exist or you do not have access to it.",
                        code="model_not_found", param="model")
