"""A bound on request bodies (`--max-request-body-bytes`): 413 in OpenAI's shape, at once.

A declared `Content-Length` over the bound is refused before a byte of the body is read; a chunked
body is counted as it arrives and refused the moment it passes the bound, so a client can neither
make the worker buffer an endless body nor hold it parsing and tokenizing megabytes."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.engine.server.errors import APIError, error_response


class RequestTooLarge(HTTPException):
    """Raised from the body's `receive`: FastAPI passes an HTTPException from there on as it is
    (any other exception would become its generic 400), and the app's handler shapes it."""

    code = "request_too_large"

    def __init__(self, max_bytes: int) -> None:
        super().__init__(413, f"The request body is larger than this worker accepts ({max_bytes} bytes; "
                              "the operator's --max-request-body-bytes).")


class BodyLimit:
    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            refusal = RequestTooLarge(self.max_bytes)
            await error_response(APIError(413, refusal.detail, code=refusal.code))(scope, receive, send)
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise RequestTooLarge(self.max_bytes)
            return message

        await self.app(scope, counting_receive, send)
