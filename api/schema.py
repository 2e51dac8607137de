"""The OpenAPI schema's error responses: every operation documents the 4xx answers it gives, with
the one error body of api.errors (OpenAI's `{"error": {...}}`).

drf-spectacular documents only the success of each operation, so a client generated from the schema
(or schemathesis) met 400, 401, 403, 404 and 409 as undocumented. `AutoSchema` adds, to what each
view declares, the errors that follow from the operation's shape:

- 401 and 403 where the operation needs credentials (a bad or revoked key, a missing scope or role,
  a suspended tenant);
- 404 where the path names a row (another tenant's row is as missing as one that never was);
- 400 where the operation takes query parameters or a body (the message names the field);
- 409, 413 and 415 where it takes a body (a state that refuses the change, a body over its limit,
  a media type no parser reads); 409 for DELETE too (a row still in use).

A code the view declares itself (with its own body) is kept as declared.
"""

from __future__ import annotations

from typing import Any

from drf_spectacular.openapi import AutoSchema as SpectacularAutoSchema
from drf_spectacular.utils import OpenApiResponse
from rest_framework import serializers


class ErrorDetailSerializer(serializers.Serializer):
    message = serializers.CharField(help_text="What was wrong, for a person.")
    type = serializers.CharField(help_text="OpenAI's error type, e.g. `invalid_request_error`, `rate_limit_error` (serving.contracts.errors).")
    code = serializers.CharField(allow_null=True, help_text="A stable code for programs, e.g. `invalid_limit`.")
    param = serializers.CharField(allow_null=True, help_text="The parameter or field at fault, when one is.")


class ErrorSerializer(serializers.Serializer):
    error = ErrorDetailSerializer()


ERROR_DESCRIPTIONS = {
    400: "Invalid request: a parameter or field is wrong (`error.param` names it).",
    401: "No API key, or one that is unknown, revoked or expired (`invalid_api_key`).",
    403: "The key or user may not do this (a missing scope or role), or the tenant is suspended.",
    404: "No such row in the caller's tenant.",
    409: "The row's state refuses the change (e.g. a version in use, a job already finished).",
    413: "The request body is over its limit.",
    415: "The body's media type is not one the operation reads.",
}
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class AutoSchema(SpectacularAutoSchema):
    def _get_response_bodies(self, direction: Any = "response") -> dict[str, Any]:
        responses: dict[str, Any] = super()._get_response_bodies(direction)
        for status_code in self.error_status_codes():
            responses.setdefault(str(status_code), self._get_response_for_code(
                error_response(ERROR_DESCRIPTIONS[status_code]), str(status_code), direction=direction))
        return responses

    def error_status_codes(self) -> list[int]:
        """The 4xx answers this operation can give, from its shape (see the module's docstring)."""
        codes = []
        if self.get_auth():
            codes += [401, 403]
        if "{" in self.path:
            codes.append(404)
        has_body = self.method in _BODY_METHODS
        if has_body or any(parameter.get("in") == "query" for parameter in self._get_parameters()):
            codes.append(400)
        if has_body:
            codes += [409, 413, 415]
        elif self.method == "DELETE":
            codes.append(409)
        return sorted(codes)


def error_response(description: str) -> OpenApiResponse:
    """A 4xx response with the error body, for a view that declares one the operation's shape does not
    imply (e.g. 404 for a row named in the body)."""
    return OpenApiResponse(ErrorSerializer, description=description)
