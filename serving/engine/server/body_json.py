"""Request bodies decoded with the bounds of serving.contracts.request_caps, before a route sees them.

FastAPI decodes a JSON body with `request.json()`; this route class hands each route a request
whose `json()` refuses `NaN`/`Infinity`, nesting deeper than the bound and every field over its cap
(`stop`, `tools`, `logit_bias`, the structured-output texts, …) with a 400 naming the field, before
pydantic builds a model of it and before anything is queued: the same bounds as the gateway's, so a
request the gateway would refuse is refused here too when it comes some other way. A body that is
not JSON stays FastAPI's own 400."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from serving.contracts import request_caps


class BodyRefused(HTTPException):
    """Raised from `json()`: FastAPI passes an HTTPException from the body's decoding on as it is
    (anything else would become its generic 400 without the field), and the app's handler shapes it
    (serving.engine.server.errors) with `param` and `code`."""

    def __init__(self, refusal: request_caps.CapExceeded) -> None:
        super().__init__(400, refusal.message)
        self.param = refusal.param
        self.code = refusal.code


class CheckedRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            try:
                body = request_caps.loads(await self.body())
                if isinstance(body, dict):
                    request_caps.check_caps(body)
            except request_caps.CapExceeded as exc:
                raise BodyRefused(exc) from None
            self._json = body
        return self._json


class CheckedJSONRoute(APIRoute):
    """A route whose JSON body is decoded by CheckedRequest (set as the app's `route_class`)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            return await handler(CheckedRequest(request.scope, request.receive))

        return checked
